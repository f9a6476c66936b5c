"""`armor serve-teacher`: options, the settings they make, and the torchrun launch of the teacher ranks.

Kept free of torch and Megatron imports, so the `armor` CLI and the trainer's launcher stay light.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import NoReturn

from megatron_armor.distributed.launch import torchrun_command

PARAMS_DTYPES = ("float32", "bfloat16")
SERVER_MODULE = "megatron_armor.teacher.server"


@dataclass(frozen=True)
class TeacherServerConfig:
    """What a teacher server runs: the checkpoint, its layout and where rank 0 listens.

    The settings of `armor serve-teacher` (its options: `argv`), which runs without a training config; the server a
    training run starts for its teacher joins three sections there (`trainer/run/build.py`'s `_teacher`: opd's
    checkpoint and layout, micro_batching's micro-batch size, model's parameter dtype).
    """

    model_path: str
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    host: str = "127.0.0.1"
    port: int = 30000  # 0 picks a free one
    micro_batch_size: int = 8  # sequences per forward micro-batch (the pipeline's unit under PP)
    params_dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"serve-teacher: {name} must be >= 1, got {getattr(self, name)}")
        if self.params_dtype not in PARAMS_DTYPES:
            raise ValueError(f"serve-teacher: params_dtype must be one of {PARAMS_DTYPES}, got {self.params_dtype!r}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def argv(self) -> list[str]:
        """The command-line options that reproduce these settings."""
        return ["--model", self.model_path, "--tp", str(self.tensor_parallel_size), "--pp",
                str(self.pipeline_parallel_size), "--host", self.host, "--port", str(self.port),
                "--micro-batch-size", str(self.micro_batch_size), "--params-dtype", self.params_dtype]


def add_serve_teacher_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = TeacherServerConfig("")
    parser.add_argument("--model", required=True, help="teacher checkpoint: HF directory or Megatron checkpoint")
    parser.add_argument("--tp", type=int, default=d.tensor_parallel_size, help="tensor-parallel size of the teacher")
    parser.add_argument("--pp", type=int, default=d.pipeline_parallel_size, help="pipeline-parallel size of the teacher")
    parser.add_argument("--host", default=d.host, help="address rank 0 binds (keep loopback unless you mean it)")
    parser.add_argument("--port", type=int, default=d.port, help="port rank 0 binds (0 picks a free one)")
    parser.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size,
                        help="sequences per forward micro-batch")
    parser.add_argument("--params-dtype", choices=PARAMS_DTYPES, default=d.params_dtype, help="parameter dtype")
    return parser


def settings_from_args(args: argparse.Namespace) -> TeacherServerConfig:
    return TeacherServerConfig(args.model, args.tp, args.pp, args.host, args.port, args.micro_batch_size,
                                 args.params_dtype)


def add_serve_teacher_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `serve-teacher` on a CLI's subparsers; dispatch it with `run_serve_teacher(args)`."""
    parser = subparsers.add_parser(
        "serve-teacher", help="serve a frozen Megatron teacher that scores tokens (OPD) at its own TP x PP",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Start tp x pp local ranks (torchrun) holding the teacher; rank 0 answers SGLang's scoring "
                    "form of /generate (max_new_tokens 0, return_logprob, logprob_start_len 0). Point "
                    "`armor train --opd.teacher_url` at it.",
    )
    return add_serve_teacher_arguments(parser)


def run_serve_teacher(args: argparse.Namespace) -> NoReturn:
    """Become torchrun running the teacher's ranks (until interrupted).

    torchrun replaces this process, so a signal to it (Ctrl-C, a supervisor's SIGTERM) reaches the
    agent that stops the ranks, which run in sessions of their own.
    """
    settings = settings_from_args(args)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = torchrun_command(settings.world_size, [SERVER_MODULE, *settings.argv()])
    os.execve(cmd[0], cmd, env)
