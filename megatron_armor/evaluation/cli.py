"""`armor eval --checkpoints CKPT... --datasets FILE --out DIR`: the subcommand's options."""

from __future__ import annotations

import argparse


def add_eval_subcommand(subparsers) -> argparse.ArgumentParser:
    """Add `eval` to an argparse subparsers object (the caller sets its handler: the run lives in the trainer)."""
    parser = subparsers.add_parser(
        "eval", help="evaluate checkpoints on benchmarks: avg@k, pass@k, maj@k",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Evaluate one or more checkpoints on the datasets of a YAML list (docs/guides/evaluation.md) "
                    "with the code of validation during training; write one JSONL row per response, results.json, "
                    "results.md (a row per checkpoint) and, for several checkpoints, a PNG per metric against the "
                    "step. Data parallel over --nproc local ranks (or the ranks torchrun launched).",
    )
    parser.add_argument("--checkpoints", required=True, nargs="+",
                        help="HF directories, Megatron checkpoints, a run's checkpoints/step_N, globs of those "
                             "(quote them: 'run/checkpoints/step_*') or a run's checkpoints/BEST")
    parser.add_argument("--datasets", required=True, help="YAML list of datasets (the file eval.datasets names)")
    parser.add_argument("--out", required=True, help="output directory (an earlier evaluation's outputs there are "
                                                     "replaced)")
    parser.add_argument("--seed", type=int, default=0,
                        help="sampling seed; a run's train.seed reproduces its validation (at any number of ranks)")
    parser.add_argument("--sglang-urls", help="comma-separated SGLang servers (or `armor serve-local`) to generate with, "
                        "shared by the ranks (none: an in-process engine on every rank)")
    parser.add_argument("--nproc", type=int, default=1, help="local data-parallel ranks (torchrun)")
    parser.add_argument("--no-progress-bar", dest="progress_bar", action="store_false",
                        help="do not show the progress bar (without this flag rank 0 shows one, a step per "
                             "checkpoint and dataset)")
    return parser
