"""`armor diagnose --base CKPT --checkpoints CKPT... --out-dir DIR`: the subcommand and its handler."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from megatron_armor.diagnostics.settings import DiagnoseConfig


def add_diagnose_subcommand(subparsers) -> argparse.ArgumentParser:
    """Add `diagnose` to an argparse subparsers object; its namespace carries `handler=run_diagnose`."""
    parser = subparsers.add_parser(
        "diagnose", help="parameter-space diagnostics of checkpoints against a base",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Compare later checkpoints with a base checkpoint matrix by matrix (unchanged fraction, "
                    "principal angles, spectral drift, mask overlap, stable rank, Hill index, subspace similarity); "
                    "write a JSON report and PNG plots to --out-dir.",
    )
    parser.add_argument("--base", required=True,
                        help="checkpoint of the stage init W0: HF directory or Megatron checkpoint (any TP/PP)")
    parser.add_argument("--checkpoints", required=True, nargs="+",
                        help="later checkpoints, HF or Megatron (e.g. a run's checkpoints/step_N/model); ordered by "
                             "the last number in their names")
    parser.add_argument("--out-dir", required=True, help="where report.json and the plots go")
    for f in fields(DiagnoseConfig):
        flag = f"--{f.name.replace('_', '-')}"
        if isinstance(f.default, tuple):
            parser.add_argument(flag, nargs="+", default=list(f.default), help=f.metadata["help"])
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default, help=f.metadata["help"])
    parser.set_defaults(handler=run_diagnose)
    return parser


def run_diagnose(args: argparse.Namespace) -> int:
    """Run the diagnostics from parsed arguments; 0 on success, 2 on a bad input."""
    from megatron_armor.diagnostics.report import REPORT_FILE, diagnose  # torch: only when the command runs

    try:
        settings = DiagnoseConfig(**{
            f.name: tuple(value) if isinstance(value := getattr(args, f.name), list) else value
            for f in fields(DiagnoseConfig)
        })
        report = diagnose(args.base, args.checkpoints, args.out_dir, settings)
    except (ValueError, KeyError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    final = report["checkpoints"][-1]
    print(f"{len(report['matrices'])} matrices, {len(report['checkpoints'])} checkpoints; at {final['label']}: "
          f"unchanged {final['all']['unchanged_fraction']:.4f}, stable rank {final['all']['stable_rank']}; "
          f"wrote {args.out_dir}/{REPORT_FILE}")
    return 0
