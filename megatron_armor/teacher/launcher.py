"""The trainer's own teacher server: `tp x pp` rank processes on this host, started, watched, stopped.

`armor serve-teacher` run by hand goes through torchrun. The trainer instead starts each teacher
rank itself (the environment torchrun would set: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), one `ManagedProcess` per rank, because then it knows which rank died and can quote
that rank's log, and every rank is SIGKILLed when the trainer dies (torchrun starts its ranks in
sessions of their own, out of reach of the launcher's death signal).

On GPUs rank r takes device r (LOCAL_RANK), as the trainer's own ranks do: give the teacher GPUs of
its own by running `armor serve-teacher` under another CUDA_VISIBLE_DEVICES (or host) and passing
`opd.teacher_url`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

from megatron_armor.rollout.process import ManagedProcess, NotReady, answers, wait_until
from megatron_armor.teacher.serve_cli import SERVER_MODULE, TeacherServerConfig
from megatron_armor.utils.net import free_port


_TORCHRUN_VARIABLES = {"GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "LOCAL_WORLD_SIZE",
                       "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"}


class TeacherError(RuntimeError):
    """The teacher could not start or score; the message names the server (and rank) and what to check."""


class TeacherServerGroup:
    """The processes of one teacher server; `url` is rank 0's HTTP address once `wait_healthy` returned."""

    def __init__(self, settings: TeacherServerConfig, *, log_dir: str | Path) -> None:
        port = settings.port or free_port(settings.host)
        self.settings = dataclasses.replace(settings, port=port)
        self.url = f"http://{settings.host}:{port}"
        master_port = free_port("127.0.0.1")
        self.ranks: list[ManagedProcess] = []
        # A trainer rank runs under torchrun: its agent's variables (TORCHELASTIC_USE_AGENT_STORE above all, which
        # would send the teacher's rendezvous to a store nobody serves) must not reach the teacher's own world.
        inherited = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARIABLES and not k.startswith("TORCHELASTIC_")}
        world = str(self.settings.world_size)
        for rank in range(self.settings.world_size):
            process = ManagedProcess(Path(log_dir) / f"teacher-rank{rank}-{port}.log")
            env = {**inherited, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world,
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port), "TOKENIZERS_PARALLELISM": "false"}
            process.start([sys.executable, "-m", SERVER_MODULE, *self.settings.argv()], env=env)
            self.ranks.append(process)

    @property
    def name(self) -> str:
        s = self.settings
        return f"teacher server {s.model_path} (tp {s.tensor_parallel_size} x pp {s.pipeline_parallel_size}, {self.url})"

    def failure(self) -> str | None:
        """None while every rank runs; else which ranks exited, with what code, and the end of their logs."""
        dead = [(rank, p) for rank, p in enumerate(self.ranks) if not p.alive()]
        if not dead:
            return None
        codes = ", ".join(f"teacher rank {rank} exited with code {p.returncode}" for rank, p in dead)
        logs = "\n".join(p.log_tail(1500) for _, p in dead)
        return f"{self.name}: {codes}\n{logs}"

    def wait_failure(self, timeout_s: float) -> str | None:
        """`failure()`, waiting up to `timeout_s` for a rank to exit (a request may fail just before it does)."""
        deadline = time.monotonic() + timeout_s
        while (report := self.failure()) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        return report

    def wait_healthy(self, timeout_s: float = 900.0, poll_s: float = 0.5) -> str:
        """Block until rank 0's /health_generate answers 200 (every rank scored a token); returns the URL."""
        def check_running() -> None:
            if (report := self.failure()) is not None:
                raise TeacherError(f"{report}\nwhile starting")

        try:
            wait_until(lambda: answers(self.url, "/health_generate"), timeout_s=timeout_s, poll_s=poll_s,
                       check=check_running)
        except NotReady as last:
            raise TeacherError(f"{self.name} was not healthy within {timeout_s:.0f} s (last: {last})\n"
                               f"{self.ranks[0].log_tail()}") from None
        return self.url

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM every rank, SIGKILL those still running after `timeout_s` (idempotent)."""
        for process in self.ranks:
            process.stop(timeout_s)
