"""One launcher for every multi-process test: run a worker script (or `python -m` module) on N gloo ranks.

The ranks are forked from a pre-imported "zygote" (multiprocessing's forkserver, which imports torch, Megatron,
transformers and this package once per test session) instead of being fresh interpreters under torchrun: each
fresh rank spent ~7 s of CPU importing the same modules, a launch of two ranks ~9 s of wall time on this 2-core box.
A rank sees what torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
sys.argv, `__name__ == "__main__"`) and, like under torchrun, when one rank fails the others are stopped.
Tests of the torchrun path itself (the CLI's relaunch, a SIGKILL mid-save) still start torchrun.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import os
import runpy
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from megatron_armor.utils.net import free_port

WORKERS = Path(__file__).parent / "workers"
RANK_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
# What the zygote imports before it forks: everything a rank of the suite's workers imports at start.
PRELOAD = ["torch", "transformers", "megatron.core", "megatron_armor.cli", "megatron_armor.trainer.run.train",
           "megatron_armor.convert.hf_to_megatron", "megatron_armor.kernels", "launcher"]
_STOP_GRACE_S = 5.0
T = TypeVar("T")


@dataclass(frozen=True)
class Launch:
    """How a launch ended: each rank's exit code (rank order) and their output, each line prefixed by its rank."""

    exit_codes: list[int]
    output: str

    @property
    def returncode(self) -> int:
        """The first non-zero exit code of a rank (0 when every rank succeeded), as torchrun reports it."""
        return next((code for code in self.exit_codes if code != 0), 0)


def _zygote() -> multiprocessing.context.ForkServerContext:
    """The forkserver context; its server starts (once per session) with the ranks' environment and preloads."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    saved = {key: os.environ.get(key) for key in RANK_ENV}
    os.environ.update(RANK_ENV)  # libgomp reads OMP_NUM_THREADS once, when torch loads in the zygote
    try:
        from multiprocessing import forkserver

        forkserver.ensure_running()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return context


def _run_rank(target: list[str], env: dict[str, str], log_path: str) -> None:
    """One rank (in a process forked from the zygote): the launching test's environment and torchrun's (`env`),
    output to `log_path`, then `target`
    (["path/to/script.py", *args] or ["-m", "module", *args]) as `__main__`; its exit code is the process's."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    code = 0
    try:
        if target[0] == "-m":
            sys.argv = [target[1], *target[2:]]
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(target)
            runpy.run_path(target[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    if code:
        raise SystemExit(code)


def _fork(target: list[str], env: dict[str, str], log_path: Path) -> multiprocessing.process.BaseProcess:
    """`target` started (not waited for) in a process forked from the zygote, with environment `env`, output to
    `log_path`."""
    process = _zygote().Process(target=_run_rank, args=(target, env, str(log_path)))
    process.start()
    return process


class Forked:
    """A process forked from the zygote running `target` (a script and its args, or "-m", a module and its args)
    until it exits or is killed, seen through the part of `subprocess.Popen`'s interface the tests use: `pid`,
    `poll()`, `wait()`, `kill()`, `terminate()` (exit codes as Popen's: -N after signal N)."""

    def __init__(self, target: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self._process = _fork(target, {**os.environ, **RANK_ENV, **(env or {})}, log_path)
        self.pid = self._process.pid

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(str(self._process.name), timeout)
        return self._process.exitcode

    def kill(self) -> None:
        if self._process.exitcode is None:
            self._process.kill()

    def terminate(self) -> None:
        if self._process.exitcode is None:
            self._process.terminate()


def launch(target: list[str], nproc: int, log_dir: Path, *, env: dict[str, str] | None = None,
           timeout: float = 600) -> Launch:
    """Run `target` (a script path and its args, or "-m", a module and its args) on `nproc` ranks of one gloo job.

    When a rank exits non-zero the others are stopped (SIGTERM, then SIGKILL), as torchrun does; past `timeout`
    seconds every rank is killed and the launch fails with its output. Each rank's output is kept in
    `log_dir/rank<r>.log`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    ranks = []
    for rank in range(nproc):
        rank_env = {**os.environ, **RANK_ENV, **(env or {}), "RANK": str(rank), "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        ranks.append(_fork(target, rank_env, log_dir / f"rank{rank}.log"))
    deadline = time.monotonic() + timeout
    timed_out = False
    while any(p.exitcode is None for p in ranks):
        running = [p.sentinel for p in ranks if p.exitcode is None]
        multiprocessing.connection.wait(running, timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        failed = any(p.exitcode not in (None, 0) for p in ranks)
        timed_out = time.monotonic() > deadline
        if failed or timed_out:
            _stop(ranks)
            break
    output = "".join(
        "".join(f"[rank{rank}] {line}" for line in (log_dir / f"rank{rank}.log").read_text(errors="replace")
                .splitlines(keepends=True))
        for rank in range(nproc)
    )
    if timed_out:
        raise AssertionError(f"{target} timed out after {timeout} s\n{output[-8000:]}")
    return Launch([p.exitcode for p in ranks], output)


def _stop(ranks: list[multiprocessing.process.BaseProcess]) -> None:
    """Stop the ranks still running: SIGTERM, then SIGKILL those alive after a grace period."""
    for process in ranks:
        if process.exitcode is None:
            os.kill(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + _STOP_GRACE_S
    for process in ranks:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.exitcode is None:
            process.kill()
            process.join()


def run_workers(worker: str, nproc: int, out_dir: Path, *args: str, timeout: int = 600) -> list[dict]:
    """Run `tests/workers/<worker>` on `nproc` ranks; each rank writes `out_dir/rank<r>.json`.

    Returns the per-rank results in rank order; fails with the workers' output on a non-zero exit. The
    workers' output (their logs) is kept in `out_dir/stderr.txt`.
    """
    result = launch([str(WORKERS / worker), str(out_dir), *args], nproc, out_dir / "logs", timeout=timeout)
    (out_dir / "stderr.txt").write_text(result.output)
    if result.returncode != 0:
        raise AssertionError(f"{worker} failed with exit codes {result.exit_codes}\n{result.output[-10000:]}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


def concurrently(*calls: Callable[[], T]) -> list[T]:
    """The results of independent calls (launches, multi-process conversions), run at once on threads, in order; the
    first failure is raised. A launch of one or two ranks leaves a core of this 2-core box idle through its start-up
    and its ranks' waits on each other; another launch beside it fills it. Only for calls whose results do not depend
    on timing and that write nothing in common (not training runs that may fill the synthetic task's shared cache)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [future.result() for future in futures]


def armor(*args: str, nproc: int, log_dir: Path, timeout: int = 600) -> Launch:
    """`armor <args>` on `nproc` ranks, as the CLI's own relaunch would run it (the layout's world size)."""
    return launch(["-m", "megatron_armor.cli", *args], nproc, log_dir, timeout=timeout)


def write_result(out_dir: str | Path, result: dict) -> None:
    """Called by a worker: store this rank's result for the test process."""
    rank = int(os.environ.get("RANK", "0"))
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
