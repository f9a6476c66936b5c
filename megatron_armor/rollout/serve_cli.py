"""`armor serve-local`: serve a local HF checkpoint over SGLang's HTTP schema (a stand-in for SGLang)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence


def add_serve_local_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", required=True, help="HF checkpoint directory to serve")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (keep loopback unless you mean it)")
    parser.add_argument("--port", type=int, default=30000, help="port to bind (0 picks a free one)")
    parser.add_argument("--random-seed", type=int, default=0, help="seed for requests without sampling_seed")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true",
                        help="weights keep their values across /release_memory_occupation (as SGLang's flag); "
                             "without it they must be loaded again before the next generation")
    parser.add_argument("--device", default="cpu",
                        help="where the engine runs: cpu, or cuda[:N] (tensor updates then arrive as CUDA-IPC handles, "
                             "weight-update groups may use NCCL, and a memory release frees GPU memory)")
    return parser


def add_serve_local_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `serve-local` on a CLI's subparsers; dispatch it with `run_serve_local(args)`."""
    parser = subparsers.add_parser(
        "serve-local", help="serve a checkpoint over SGLang's HTTP API (CPU, or one GPU), without SGLang",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Serve an HF checkpoint with the in-process engine behind SGLang's HTTP endpoints "
                    "(/generate, /update_weights_from_tensor, /flush_cache, ...).",
    )
    return add_serve_local_arguments(parser)


def run_serve_local(args: argparse.Namespace) -> int:
    from megatron_armor.rollout.http_server import serve_local

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    serve_local(args.model, host=args.host, port=args.port, random_seed=args.random_seed,
                weights_cpu_backup=args.enable_weights_cpu_backup, device=args.device)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m megatron_armor.rollout.http_server --model DIR --port N`."""
    parser = add_serve_local_arguments(argparse.ArgumentParser(prog="python -m megatron_armor.rollout.http_server"))
    return run_serve_local(parser.parse_args(argv))
