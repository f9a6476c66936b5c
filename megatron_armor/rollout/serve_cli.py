"""`armor serve-local`: serve a local HF checkpoint over SGLang's HTTP schema (a stand-in for SGLang)."""

from __future__ import annotations

import argparse


def add_serve_local_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", required=True, help="HF checkpoint directory to serve")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (keep loopback unless you mean it)")
    parser.add_argument("--port", type=int, default=30000, help="port to bind (0 picks a free one)")
    parser.add_argument("--random-seed", type=int, default=0, help="seed for requests without sampling_seed")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true",
                        help="weights keep their values across /release_memory_occupation (as SGLang's flag); "
                             "without it they must be loaded again before the next generation")
    parser.add_argument("--enable-return-routed-experts", action="store_true",
                        help="a MoE model's engine records the experts it routes every token to, and /generate requests "
                             "with return_routed_experts get them in meta_info.routed_experts (as SGLang's flag: "
                             "base64 int32 [prompt + completion - 1, layers, top-k])")
    parser.add_argument("--device", default="cpu",
                        help="where the engine runs: cpu, or cuda[:N] (tensor updates then arrive as CUDA-IPC handles, "
                             "weight-update groups may use NCCL, and a memory release frees GPU memory)")
    return parser


def add_serve_local_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `serve-local` on a CLI's subparsers; dispatch it with `http_server.run_serve_local(args)`."""
    parser = subparsers.add_parser(
        "serve-local", help="serve a checkpoint over SGLang's HTTP API (CPU, or one GPU), without SGLang",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Serve an HF checkpoint with the in-process engine behind SGLang's HTTP endpoints "
                    "(/generate, /update_weights_from_tensor, /flush_cache, ...).",
    )
    return add_serve_local_arguments(parser)
