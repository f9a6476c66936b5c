"""`armor plan --config FILE --gpus N --gpu-memory-gb M [--tp --pp --dp --section.field VALUE ...]`."""

from __future__ import annotations

import argparse
import sys


def add_plan_subcommand(subparsers, add_config_arguments) -> argparse.ArgumentParser:
    """Add `plan` to an argparse subparsers object; `add_config_arguments` adds the config options of
    `armor train` (config file, --tp/--pp/--dp, every config field). The caller loads the config and calls `run_plan`."""
    parser = subparsers.add_parser(
        "plan", help="estimate a layout's per-GPU memory and an RL step's FLOPs; say whether it fits",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Print, per GPU, the bytes of weights, gradients, optimizer state (with and without the "
                    "distributed optimizer), activations per micro-batch under the configured recomputation and token "
                    "budget, the LM head's logits (torch and fused head), the frozen reference / teacher models and "
                    "what is left for an SGLang server's KV cache; whether the layout fits and which knob to turn "
                    "when it does not; and the training FLOPs of one RL step. An estimate from the model's shape: "
                    "nothing is allocated. A model.path that is not a local directory is looked up in a built-in "
                    "table of the recipes' models.",
    )
    parser.add_argument("--gpus", type=int, required=True, help="GPUs of the job in all (trainer and servers)")
    parser.add_argument("--gpu-memory-gb", type=float, required=True, help="memory of one GPU in GB (10^9 bytes)")
    parser.add_argument("--reserve-gb", type=float, default=4.0,
                        help="GiB per GPU kept for the CUDA context, NCCL buffers and fragmentation")
    parser.add_argument("--server-tp", type=int, help="tensor-parallel size of an SGLang server (default: the trainer's tp)")
    parser.add_argument("--server-mem-fraction", type=float, default=0.8,
                        help="fraction of a GPU an SGLang server takes for weights and KV cache (--mem-fraction-static)")
    add_config_arguments(parser)
    return parser


def run_plan(args: argparse.Namespace, cfg) -> int:
    """Print the plan of the loaded config `cfg` (an ArmorConfig); 0 when the layout fits, 1 when it does not,
    2 when the model's shape cannot be found or the layout does not split it."""
    from megatron_armor.planning.planner import Hardware, plan_run  # imports torch: not for --help
    from megatron_armor.planning.report import format_plan

    try:
        plan = plan_run(cfg, Hardware(args.gpus, args.gpu_memory_gb, args.reserve_gb, args.server_tp,
                                      args.server_mem_fraction))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    return 0 if plan.memory.fits and plan.trainer_gpus <= plan.gpus else 1
