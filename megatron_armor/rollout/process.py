"""`ManagedProcess`: one subprocess in its own session, its output in a log file, stopped as a group.

Shared by the rollout servers (`launch/server_process.RolloutServer`), SGLang's router (`router.SGLangRouter`) and
the OPD teacher's server ranks (`teacher/launcher.py`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from megatron_armor.rollout.sglang_engine import TRANSPORT_ERRORS, ServerError, http_call


class NotReady(RuntimeError):
    """`wait_until` gave up; the message is the last error `ready` raised ("no answer yet" if none)."""


def wait_until(ready: Callable[[], bool], *, timeout_s: float, poll_s: float, check: Callable[[], None] = lambda: None) -> None:
    """Call `ready()` every `poll_s` seconds until it returns True; a server or connection error it
    raises counts as "not yet". `check()` runs first in each round and may raise (a process that
    died). Raises `NotReady` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while True:
        check()
        try:
            if ready():
                return
        except (ServerError, *TRANSPORT_ERRORS) as error:
            last = f"{type(error).__name__}: {error}"
        if time.monotonic() >= deadline:
            raise NotReady(last)
        time.sleep(poll_s)


def answers(url: str, path: str) -> bool:
    """True when GET `url + path` answers 200 (errors raise, for `wait_until`)."""
    http_call(url, path, method="GET", timeout=30.0)
    return True


def _die_with_parent() -> None:
    """Linux: SIGKILL the child when the process that started it dies (a killed Ray actor leaves no orphan)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class ManagedProcess:
    """Starts `cmd` (again after a death, if asked) with stdout and stderr appended to `log_path`.

    The child runs in its own session, so `kill` and `stop` reach its children too (SGLang's scheduler
    processes), and it is SIGKILLed when its parent dies.
    """

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._proc: subprocess.Popen | None = None

    def start(self, cmd: Sequence[str], env: dict[str, str] | None = None) -> None:
        """Start `cmd` with `env` (None: this process's environment)."""
        with self.log_path.open("a") as sink:
            sink.write(f"$ {' '.join(cmd)}\n")
            sink.flush()
            self._proc = subprocess.Popen(list(cmd), stdout=sink, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True, preexec_fn=_die_with_parent)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group (what is left of it: children of a dead leader may still hold a GPU)."""
        self._signal_group(signal.SIGKILL)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the process group, SIGKILL it if the leader has not exited after `timeout_s` (idempotent)."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self._signal_group(signal.SIGKILL)
        self._proc.wait()

    def log_tail(self, chars: int = 3000) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return f"--- {self.log_path} (last {chars} chars) ---\n{text[-chars:]}"

    def _signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self._proc.pid, sig)
        except ProcessLookupError:  # the whole group is gone already
            pass
