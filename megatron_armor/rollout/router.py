"""`SGLangRouter`: SGLang's router (`python -m sglang_router.launch_router`, sglang-router 0.3.2) in front of
rollout servers, as a subprocess: start, readiness, worker registration, shutdown.

Generation requests go to `router.url` and the router picks a worker by its policy (retrying a failed
request on another worker). It does not fan out weight updates, flushes or pauses, so
`SGLangEngine(urls, router_url=router.url)` sends those to every server directly.

As slime runs it (slime/ray/rollout.py), the router's own worker health checks are off: the launcher
restarts dead servers and re-registers them. Its circuit breaker is off too, so a restarted server at
the same URL gets requests at once; a request that fails on a dead worker is retried on another one by
the router, then by the client. Workers join with `POST /workers` {url, worker_type} (accepted at once
and added in the background, so `add_workers` waits until `GET /workers` lists them) and leave with
`DELETE /workers/{id}`.
"""

from __future__ import annotations

import importlib
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_armor.rollout.process import ManagedProcess, NotReady, wait_until
from megatron_armor.rollout.sglang_engine import TRANSPORT_ERRORS, http_call
from megatron_armor.utils.net import free_port


class RouterError(RuntimeError):
    """SGLang's router is missing, exited, or did not start or (de)register a worker in time."""


def router_installed() -> bool:
    """True when the `sglang_router` package can be imported."""
    try:
        importlib.import_module("sglang_router")
    except ImportError:
        return False
    return True


def use_sglang_router(mode: str, num_servers: int) -> bool:
    """Whether `rollout.sglang.router` = `mode` dispatches over `num_servers` servers through SGLang's router.

    "auto": when there is more than one server to balance and sglang_router is installed (in front
    of one server a router adds a hop and nothing else); "sglang": always (RouterError if it is not
    installed); "none": never (the client's own least-loaded dispatcher).
    """
    if mode not in ("auto", "sglang", "none"):
        raise ValueError(f"rollout.sglang.router must be auto, sglang or none, got {mode!r}")
    if mode == "none":
        return False
    installed = router_installed()
    if mode == "sglang" and not installed:
        raise RouterError("rollout.sglang.router is 'sglang' but the sglang_router package is not installed: "
                          "pip install sglang-router==0.3.2, or set rollout.sglang.router auto or none")
    return installed and (mode == "sglang" or num_servers > 1)


@dataclass(frozen=True)
class RouterConfig:
    """How the router runs; times in seconds."""

    policy: str = "cache_aware"  # one of rollout.sglang.router_policy's choices; sglang-router's default
    request_timeout_s: int = 1800  # --request-timeout-secs: longest generation request it forwards
    startup_timeout_s: float = 60.0  # for the router to answer GET /health
    worker_timeout_s: float = 900.0  # for a registered worker to be listed (the router checks it is up first)
    poll_interval_s: float = 0.2


def router_command(spec: RouterConfig, *, host: str, port: int, metrics_port: int) -> list[str]:
    """The argv of a router on `host:port` with no workers yet (they join through `add_workers`)."""
    return [
        sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port),
        "--policy", spec.policy, "--request-timeout-secs", str(spec.request_timeout_s),
        "--worker-startup-timeout-secs", str(int(spec.worker_timeout_s)), "--worker-startup-check-interval", "1",
        "--disable-health-check", "--disable-circuit-breaker", "--log-level", "warn",
        "--prometheus-host", host, "--prometheus-port", str(metrics_port),  # its own port: routers side by side
    ]


class SGLangRouter:
    """A router subprocess on `host` (a free port), with `worker_urls` registered when the constructor returns.

    Use as a context manager, or call `stop()`; the router also dies with the process that started it.
    """

    def __init__(
        self, worker_urls: Sequence[str] = (), spec: RouterConfig = RouterConfig(), *, host: str = "127.0.0.1",
        log_dir: str | None = None,
    ) -> None:
        self.spec, self.host = spec, host
        self.port = free_port(host)
        self._process = ManagedProcess(Path(log_dir or tempfile.gettempdir()) / f"sglang-router-{self.port}.log")
        self._process.start(router_command(spec, host=host, port=self.port, metrics_port=free_port(host)))
        try:
            self._wait_for(self._answers_health, spec.startup_timeout_s, "answer /health")
            self.add_workers(worker_urls)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def pid(self) -> int:
        return self._process.pid

    def workers(self) -> dict[str, str]:
        """Registered workers: URL -> the router's worker id."""
        return {w["url"]: w["id"] for w in self._get("/workers")["workers"]}

    def add_workers(self, urls: Sequence[str]) -> None:
        """Register `urls` (already registered ones are kept) and wait until the router lists them all."""
        urls = [url.rstrip("/") for url in urls]
        for url in urls:
            self._call("/workers", {"url": url, "worker_type": "regular"})
        self._wait_for(lambda: set(urls) <= self.workers().keys(), self.spec.worker_timeout_s,
                       f"list workers {urls} (is each one up and reachable from the router?)")

    def remove_worker(self, url: str) -> None:
        """Deregister `url` (no-op when it is not registered) and wait until the router no longer lists it."""
        url = url.rstrip("/")
        worker_id = self.workers().get(url)
        if worker_id is None:
            return
        self._call(f"/workers/{worker_id}", method="DELETE")
        self._wait_for(lambda: url not in self.workers(), self.spec.startup_timeout_s, f"drop worker {url}")

    def check_alive(self) -> None:
        """Raise RouterError (quoting the router's log) if the router process has exited."""
        if not self._process.alive():
            raise self._exited()

    def stop(self) -> None:
        """Stop the router process (idempotent)."""
        self._process.stop(timeout_s=10.0)

    def __enter__(self) -> SGLangRouter:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _answers_health(self) -> bool:
        self._get("/health")  # raises until the router listens
        return True

    def _get(self, path: str) -> Any:
        return self._call(path, method="GET")

    def _call(self, path: str, body: Any = None, *, method: str = "POST") -> Any:
        """`http_call` to the router; a RouterError quoting the router's log if its process is gone."""
        self.check_alive()
        try:
            return http_call(self.url, path, body, method=method, timeout=30.0)
        except TRANSPORT_ERRORS as error:
            if not self._process.alive():
                raise self._exited() from error
            raise

    def _wait_for(self, done: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Poll `done()` (connection errors count as not done); RouterError after `timeout_s`."""
        try:
            wait_until(done, timeout_s=timeout_s, poll_s=self.spec.poll_interval_s)
        except NotReady as last:
            raise RouterError(f"SGLang router {self.url} did not {what} within {timeout_s:.0f} s (last: {last})\n"
                              f"{self._process.log_tail()}") from None

    def _exited(self) -> RouterError:
        return RouterError(f"SGLang router {self.url} exited with code {self._process.returncode}; generation requests "
                           f"cannot be dispatched (its log says why)\n{self._process.log_tail()}")
