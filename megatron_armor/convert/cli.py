"""`armor convert hf-to-megatron|megatron-to-hf`: the subcommand, its handler, and a standalone main.

    armor convert hf-to-megatron --hf-path DIR --out DIR --tp N --pp M [--ep E] [--etp T] [--overwrite]
    armor convert megatron-to-hf --megatron-path DIR --out DIR [--pp M] [--overwrite]
                                 [--max-shard-size GB]

`python -m megatron_armor.convert.cli ...` is the same command; hf-to-megatron re-runs it under
torchrun for its tp x pp ranks, megatron-to-hf for its pp ranks (pp > 1). Keep this module's
imports light: Megatron's checkpoint writer spawns a helper process that re-imports the main module.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_convert_subcommand(subparsers) -> argparse.ArgumentParser:
    """Add `convert` (with `hf-to-megatron` and `megatron-to-hf`) to an argparse subparsers object.

    Namespaces carry `handler=run_convert`.
    """
    parser = subparsers.add_parser(
        "convert", help="convert checkpoints between Hugging Face and Megatron formats",
        description="Convert Llama / Mistral / Mixtral / Qwen2 / Qwen3 / Qwen2-MoE / Qwen3-MoE / GLM-4.5 checkpoints "
                    "between Hugging Face safetensors and Megatron distributed checkpoints (loadable at any TP/PP "
                    "layout, and by `armor train` as model.path).",
    )
    directions = parser.add_subparsers(dest="direction", required=True)
    to_megatron = directions.add_parser(
        "hf-to-megatron", help="HF safetensors -> Megatron distributed checkpoint",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Convert with tp x pp local processes, each reading its shard's rows / columns of the HF "
                    "tensors one parameter at a time (memory: one parameter shard, never the model).",
    )
    to_megatron.add_argument("--hf-path", required=True, help="HF checkpoint directory (config.json + safetensors)")
    to_megatron.add_argument("--out", required=True, help="output directory for the Megatron checkpoint")
    to_megatron.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel size to save at (and processes)")
    to_megatron.add_argument("--pp", type=_positive_int, default=1, help="pipeline-parallel size to save at (and processes)")
    to_megatron.add_argument("--ep", type=_positive_int, default=1,
                             help="MoE models: expert-parallel size to save at (processes: tp x pp x ep at --etp tp)")
    to_megatron.add_argument("--etp", type=_positive_int, default=None,
                             help="MoE models: expert tensor-parallel size to save at (default: --tp); processes: "
                                  "tp x pp x dp, dp the fewest that make etp x ep divide tp x dp")
    to_megatron.add_argument("--overwrite", action="store_true", help="replace a checkpoint already at --out")
    to_megatron.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a rank under torchrun
    to_hf = directions.add_parser(
        "megatron-to-hf", help="Megatron distributed checkpoint -> HF safetensors",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Export with pp local processes, each loading only its pipeline stage and writing its "
                    "tensors into safetensors files (renamed to one HF checkpoint with an index).",
    )
    to_hf.add_argument("--megatron-path", required=True, help="directory written by hf-to-megatron (or the trainer)")
    to_hf.add_argument("--out", required=True, help="output directory for the HF checkpoint")
    to_hf.add_argument("--pp", type=_positive_int, default=1,
                       help="processes, one pipeline stage each (memory per process ~ model / pp); divides the layers")
    to_hf.add_argument("--overwrite", action="store_true", help="replace a checkpoint already at --out")
    to_hf.add_argument("--max-shard-size", type=float, default=2.0, help="largest safetensors file, in GB")
    to_hf.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a rank under torchrun
    parser.set_defaults(handler=run_convert)
    return parser


def run_convert(args: argparse.Namespace) -> int:
    """Run the conversion from parsed arguments; 0 on success, 2 on a bad input, 1 on a failed worker."""
    from megatron_armor.convert.output_dir import OutputExistsError  # torch: only when the command runs
    from megatron_armor.convert.weights import CheckpointError
    from megatron_armor.convert.workers import ConversionError
    from megatron_armor.models.hf_config import ModelConfigError

    try:
        if args.direction == "hf-to-megatron":
            return _hf_to_megatron(args)
        return _megatron_to_hf(args)
    except (ModelConfigError, CheckpointError, OutputExistsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except ConversionError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


def _hf_to_megatron(args: argparse.Namespace) -> int:
    from megatron_armor.convert.hf_to_megatron import convert_hf_to_megatron, write_megatron_shards

    if args.worker:  # one of the tp x pp ranks launched by convert_hf_to_megatron
        write_megatron_shards(args.hf_path, args.out, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
        return 0
    out = convert_hf_to_megatron(args.hf_path, args.out, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp,
                                 overwrite=args.overwrite)
    print(f"wrote Megatron checkpoint {out} (saved at tp {args.tp} x pp {args.pp}; loads at any layout)")
    return 0


def _megatron_to_hf(args: argparse.Namespace) -> int:
    from megatron_armor.convert.hf_export import convert_megatron_to_hf, write_hf_stage

    max_shard_bytes = int(args.max_shard_size * 1024**3)
    if args.worker:  # one of the pp ranks launched by convert_megatron_to_hf
        write_hf_stage(args.megatron_path, args.out, pp=args.pp, max_shard_bytes=max_shard_bytes)
        return 0
    out = convert_megatron_to_hf(
        args.megatron_path, args.out, pp=args.pp, overwrite=args.overwrite, max_shard_bytes=max_shard_bytes
    )
    print(f"wrote Hugging Face checkpoint {out} (exported by {args.pp} process(es))")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_armor.convert.cli")
    add_convert_subcommand(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["convert", *(sys.argv[1:] if argv is None else argv)])
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
