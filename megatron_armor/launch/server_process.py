"""One rollout server subprocess: its command line, start, readiness, restart and shutdown.

The command is SGLang's (`python -m sglang.launch_server`, sglang.md §1) or, on CPU, the stand-in
`python -m megatron_armor.rollout.http_server` that speaks the same HTTP schema. `RolloutServer` is
a plain class; `servers.ServerGroup` runs it inside a Ray actor on the node (and GPUs) Ray placed it
on, so the subprocess inherits that actor's `CUDA_VISIBLE_DEVICES`.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megatron_armor.rollout.process import ManagedProcess, NotReady, answers, wait_until
from megatron_armor.utils.net import free_port


class ServerStartError(RuntimeError):
    """A rollout server exited or stayed unhealthy while starting; the message names it and quotes its log."""


@dataclass(frozen=True)
class ServerConfig:
    """What every server of a group runs. Seeds differ per server (see `seed_for`).

    kind "sglang" runs `sglang.launch_server` (GPU); "local" runs the CPU stand-in (tp_size 1 only).
    """

    model_path: str
    kind: Literal["sglang", "local"] = "sglang"
    tp_size: int = 1  # GPUs per server (--tp-size)
    mem_fraction_static: float | None = None  # None: SGLang picks
    seed: int = 0
    enable_memory_saver: bool = False  # needed for release/resume_memory_occupation (colocated)
    # Weights keep their values across a release (colocated servers whose weights are not pushed after each one)
    enable_weights_cpu_backup: bool = False
    # Each generation returns the experts its tokens were routed to (train.routing_replay rollout, MoE models)
    return_routed_experts: bool = False
    # > 0: LoRA adapters of up to this rank are loaded at run time (model.lora.weight_sync adapter); SGLang needs
    # --enable-lora with the rank and the adapted layers declared at launch, serve-local takes them without a flag
    max_lora_rank: int = 0
    extra_args: tuple[str, ...] = ()  # passed through verbatim, e.g. ("--dtype", "bfloat16")
    startup_timeout_s: float = 900.0
    poll_interval_s: float = 2.0  # slime polls /health_generate every 2 s

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"ServerConfig.tp_size must be >= 1, got {self.tp_size}")
        if self.kind == "local" and self.tp_size != 1:
            raise ValueError(f"the CPU stand-in server has no tensor parallelism; tp_size must be 1, got {self.tp_size}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"ServerConfig.mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")

    def seed_for(self, index: int) -> int:
        """Server `index`'s --random-seed: distinct per server, as slime's seed + rank * gpus."""
        return self.seed + index * self.tp_size


def server_command(spec: ServerConfig, *, host: str, port: int, seed: int) -> list[str]:
    """The argv that starts one server of `spec` on `host:port`."""
    if spec.kind == "local":
        backup = ["--enable-weights-cpu-backup"] if spec.enable_weights_cpu_backup else []
        return [sys.executable, "-m", "megatron_armor.rollout.http_server", "--model", spec.model_path,
                "--host", host, "--port", str(port), "--random-seed", str(seed), *backup, *_routes_flag(spec),
                *spec.extra_args]
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", spec.model_path, "--host", host,
           "--port", str(port), "--tp-size", str(spec.tp_size), "--random-seed", str(seed), "--skip-tokenizer-init"]
    if spec.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(spec.mem_fraction_static)]
    if spec.enable_memory_saver:
        cmd.append("--enable-memory-saver")
    if spec.enable_weights_cpu_backup:
        cmd.append("--enable-weights-cpu-backup")
    if spec.max_lora_rank:
        cmd += ["--enable-lora", "--max-lora-rank", str(spec.max_lora_rank), "--lora-target-modules", "all"]
    return cmd + _routes_flag(spec) + list(spec.extra_args)


def _routes_flag(spec: ServerConfig) -> list[str]:
    """SGLang's flag (which `armor serve-local` shares) for returning routed experts, when `spec` asks for them."""
    return ["--enable-return-routed-experts"] if spec.return_routed_experts else []


class RolloutServer:
    """Owns one server subprocess (in its own session, so a stop reaches SGLang's children too)."""

    def __init__(self, spec: ServerConfig, index: int, *, host: str, log_dir: str | None = None) -> None:
        self.spec, self.index, self.host = spec, index, host
        self.port = free_port(host)
        self.restarts = 0
        log_path = Path(log_dir or tempfile.gettempdir()) / f"rollout-server-{index}-{self.port}.log"
        self._process = ManagedProcess(log_path)
        self._start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def name(self) -> str:
        return f"rollout server {self.index} ({self.url})"

    def pid(self) -> int:
        return self._process.pid

    def alive(self) -> bool:
        return self._process.alive()

    def _start(self) -> None:
        cmd = server_command(self.spec, host=self.host, port=self.port, seed=self.spec.seed_for(self.index))
        self._process.start(cmd, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})

    def wait_healthy(self) -> str:
        """Block until GET /health_generate answers 200; returns the URL.

        Raises ServerStartError (with the log's tail) when the process exits or the timeout passes.
        """
        def check_running() -> None:
            if not self.alive():
                raise ServerStartError(f"{self.name} exited with code {self._process.returncode} while starting\n"
                                       f"{self._process.log_tail()}")

        try:
            wait_until(lambda: answers(self.url, "/health_generate"), timeout_s=self.spec.startup_timeout_s,
                       poll_s=self.spec.poll_interval_s, check=check_running)
        except NotReady as last:
            raise ServerStartError(f"{self.name} was not healthy within {self.spec.startup_timeout_s:.0f} s "
                                   f"(last: {last})\n{self._process.log_tail()}") from None
        return self.url

    def ensure_alive(self) -> bool:
        """Restart the server on the same port if its process died; True when it did (after it is healthy).

        A restarted server holds the checkpoint's weights until the trainer's next weight sync.
        """
        if self.alive():
            return False
        self._process.kill()  # children of a dead SGLang server may still hold the GPU
        self.restarts += 1
        self._start()
        self.wait_healthy()
        return True

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the server's process group, SIGKILL it if the server has not exited after `timeout_s`."""
        self._process.stop(timeout_s)
