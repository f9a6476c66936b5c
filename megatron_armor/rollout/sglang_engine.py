"""`SGLangEngine`: the `RolloutEngine` interface over HTTP to one or more SGLang servers.

Prompts are cut into requests of `prompts_per_request`; a thread pool keeps at most
`max_in_flight_per_server * len(urls)` requests in flight, each sent to the least-loaded live server.
A request whose server fails (connection lost, timeout, 5xx) is re-sent to another server after an
exponential backoff, and the failed server sits out `down_cooldown_s`; prompts SGLang answers with
finish type "abort" are re-sent too. Every re-send counts in `stats.retries` (metric
`rollout/retries`); finished prompts are kept, so a retry never loses or repeats a result. Once one
request fails for good, `generate` aborts the others in flight, sends no more and raises at once.
With `router_url` (SGLang's router in front of the same servers, rollout/router.py) every /generate
request goes to the router instead, one prompt per request, and the router picks the worker; the
retries above still apply. Flushes, memory hand-off and health always go to every server directly (the
router does not fan them out); weight updates to the engine's push servers (`push_urls`, default all). A LoRA
adapter loads from tensors on the push servers (`load_lora_adapter`), and a `generate` call that names it samples
with it (SGLang's `lora_path`; none named: the base). Stdlib HTTP only (`http.client`).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import torch

from megatron_armor.config import WeightSyncConfig
from megatron_armor.rollout import sglang_protocol as proto
from megatron_armor.rollout.base import Generation, RolloutEngine, SamplingParams
from megatron_armor.rollout.weight_transport import Transport
from megatron_armor.utils.net import on_this_host

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SGLangEngineConfig:
    """Client knobs; times in seconds.

    The retries, timeouts and polling are the client's own (no config field sets them); its weight pushes are the
    rollout.weight_sync section as loaded (`weight_sync`: method, directory, payload and bucket size), which a
    training run's backend passes in (rollout/backends.py).
    """

    prompts_per_request: int = 16  # through a router: 1 per request, this many times more requests in flight
    max_in_flight_per_server: int = 4
    request_timeout_s: float = 600.0
    max_retries: int = 4  # re-sends per request before `generate` fails
    backoff_s: float = 0.5  # first retry delay; doubles per retry up to max_backoff_s
    max_backoff_s: float = 8.0
    down_cooldown_s: float = 30.0  # a failed server gets no new requests for this long
    startup_timeout_s: float = 600.0
    poll_interval_s: float = 1.0  # readiness polling while waiting for servers to come up
    health_timeout_s: float = 30.0
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)  # how pushes reach the servers
    weight_group_timeout_s: float = 300.0  # weight_sync distributed: forming the group, each broadcast
    flush_attempts: int = 60  # /flush_cache answers 400 while requests run; slime retries 60 x 1 s
    flush_interval_s: float = 1.0
    routed_experts_shape: tuple[int, int] | None = None  # (L, k): ask for every item's routed experts (servers need
    # --enable-return-routed-experts) and read them as [N, L, k] (`Generation.routed_experts`)


@dataclass
class RolloutStats:
    """Counters since the engine was made (cumulative)."""

    requests: int = 0  # /generate requests sent, re-sends included
    retries: int = 0  # re-sends after a failed request or aborted prompts
    aborted_prompts: int = 0  # prompts returned with finish type "abort"
    failed_requests: int = 0  # requests lost to a dead, slow or failing server
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def as_metrics(self) -> dict[str, float]:
        names = ("requests", "retries", "aborted_prompts", "failed_requests")
        return {f"rollout/{name}": float(getattr(self, name)) for name in names}


class ServerError(RuntimeError):
    """A server answered with an HTTP error status."""

    def __init__(self, url: str, path: str, status: int, detail: str) -> None:
        super().__init__(f"{url}{path} answered HTTP {status}: {detail[:500]}")
        self.status = status


class RolloutError(RuntimeError):
    """`generate` gave up; `partial` holds the generations that did finish (None elsewhere)."""

    def __init__(self, message: str, partial: list[Generation | None] | None = None) -> None:
        super().__init__(message)
        self.partial = partial


class _ServerFailed(Exception):
    """A request lost to a dead, slow or failing server; another server may succeed."""


class _Stopped(Exception):
    """The `generate` call gave up (another request failed for good): send nothing more."""


TRANSPORT_ERRORS = (OSError, http.client.HTTPException)  # refused, reset, timed out, malformed


def http_call(url: str, path: str, body: Any = None, *, method: str = "POST", timeout: float = 60.0) -> Any:
    """One request to `url` + `path`; returns parsed JSON, plain text, or None for an empty body.

    Raises ServerError on HTTP >= 400 and TRANSPORT_ERRORS when the server cannot be reached.
    """
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    text = raw.decode("utf-8", errors="replace")
    if response.status >= 400:
        raise ServerError(url, path, response.status, text)
    if not raw:
        return None
    return json.loads(text) if "json" in (response.getheader("Content-Type") or "") else text


def server_weight_version(url: str, timeout: float) -> str | None:
    """The weight_version the server at `url` reports (/model_info; "None" from one that reports none), None when it
    does not answer."""
    try:
        return str(http_call(url, "/model_info", method="GET", timeout=timeout).get("weight_version"))
    except (ServerError, *TRANSPORT_ERRORS):
        return None


def _failure_message(path: str, failures: dict[str, Exception], total: int) -> str:
    """`path` failed on these of `total` servers, each with its error."""
    return (f"{path} failed on {len(failures)}/{total} servers: "
            + " | ".join(f"{url}: {type(e).__name__}: {e}" for url, e in failures.items()))


@dataclass
class _Server:
    url: str
    tp_size: int = 1
    in_flight: int = 0
    down_until: float = 0.0


class _Dispatcher:
    """Least-loaded choice among servers not cooling down after a failure (all of them if none is up), never a
    retired one (it missed a weight push: `SGLangEngine.retire_servers`). Ties between equally loaded servers go
    round-robin from `first` (the server after the last one chosen), so clients that each send one request at a time
    (one per rank) spread over the servers when each starts at a different `first` (its rank)."""

    def __init__(self, servers: list[_Server], cooldown_s: float, first: int = 0) -> None:
        self.servers, self.cooldown_s = servers, cooldown_s
        self.retired: set[str] = set()
        self._next = first % len(servers)  # where the round-robin among equally loaded servers starts
        self._lock = threading.Lock()

    def acquire(self, avoid: str | None = None) -> _Server:
        with self._lock:
            now = time.monotonic()
            serving = [s for s in self.servers if s.url not in self.retired]
            if not serving:
                raise RolloutError(f"every server ({', '.join(s.url for s in self.servers)}) missed the last weight "
                                   f"push (dead, or back without the current weights): nothing can generate")
            up = [s for s in serving if s.down_until <= now] or serving
            preferred = [s for s in up if s.url != avoid] or up
            index, server = min(((i, s) for i, s in enumerate(self.servers) if s in preferred),
                                key=lambda pair: (pair[1].in_flight, (pair[0] - self._next) % len(self.servers)))
            self._next = index + 1
            server.in_flight += 1
            return server

    def release(self, server: _Server, *, failed: bool) -> None:
        with self._lock:
            server.in_flight -= 1
            if failed:
                server.down_until = time.monotonic() + self.cooldown_s


class _InFlight:
    """One `generate` call's /generate requests in flight, and its stop flag."""

    def __init__(self) -> None:
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        self._requests: dict[str, tuple[list[str], list[str]]] = {}  # rid -> (urls to abort on, item rids)

    @contextlib.contextmanager
    def sending(self, rid: str, urls: list[str], item_rids: list[str]) -> Iterator[None]:
        """Register a request while it is sent; _Stopped (send nothing) once the call has halted."""
        with self._lock:
            if self.stopped.is_set():
                raise _Stopped
            self._requests[rid] = (urls, item_rids)
        try:
            yield
        finally:
            with self._lock:
                del self._requests[rid]

    def halt(self) -> list[tuple[list[str], list[str]]]:
        """Stop every later attempt; returns the requests still in flight as (urls, item rids), to abort."""
        with self._lock:
            self.stopped.set()
            return list(self._requests.values())

    def requests(self) -> list[tuple[list[str], list[str]]]:
        """The requests in flight as (urls, item rids)."""
        with self._lock:
            return list(self._requests.values())


class SGLangEngine(RolloutEngine):
    """Rollouts from SGLang servers (or `armor serve-local` stand-ins) at `urls`; blocks until all are healthy.

    router_url: SGLang's router in front of exactly these servers; generation goes through it.
    push_urls: the servers `update_weights` pushes to (default: all; the trainer deals them out over its
    ranks, `rollout.push_assignment`); memory hand-off, flushes and generation still reach every server.
    first_server: where the dispatcher's round-robin between equally loaded servers starts (the trainer passes
    its rank, so ranks with a request each send them to different servers).
    """

    def __init__(
        self, urls: Sequence[str], config: SGLangEngineConfig = SGLangEngineConfig(), *, router_url: str | None = None,
        push_urls: Sequence[str] | None = None, first_server: int = 0,
    ) -> None:
        if not urls:
            raise ValueError("SGLangEngine needs at least one server URL")
        push_urls = list(urls) if push_urls is None else list(push_urls)
        if not set(push_urls) <= set(urls):
            raise ValueError(f"push_urls {sorted(set(push_urls) - set(urls))} are not among the servers {list(urls)}")
        if config.weight_sync.method == "tensor":
            elsewhere = [url for url in push_urls if not on_this_host(url)]
            if elsewhere:
                raise ValueError(
                    f"weight_sync tensor hands the servers shared-memory / CUDA-IPC handles, which only a server on "
                    f"this host can open, but {', '.join(elsewhere)} {'is' if len(elsewhere) == 1 else 'are'} not on "
                    f"this host: use rollout.weight_sync.method distributed (or disk)"
                )
        self.config = config
        self.stats = RolloutStats()
        self._servers = [_Server(url.rstrip("/")) for url in urls]
        self._push_servers = [server for url, server in zip(urls, self._servers) if url in push_urls]
        self._router = _Server(router_url.rstrip("/")) if router_url else None
        self._dispatcher = _Dispatcher([self._router] if self._router else self._servers, config.down_cooldown_s,
                                       first_server)
        self.wait_until_ready()
        for server in self._servers:
            server.tp_size = int(http_call(server.url, "/server_info", method="GET").get("tp_size", 1))
        # the push servers the last push reached (the transport's servers: updated in place); the others missed it
        self._live_push_servers = list(self._push_servers)
        self._transport: Transport = config.weight_sync.build(
            servers=self._live_push_servers, post_all=self._on_push_servers,
            group_timeout_s=config.weight_group_timeout_s,
        )
        self._weight_version = 0
        self._interrupted = threading.Event()  # `interrupt`: aborted items come back partial, nothing more is sent
        self._calls_lock = threading.Lock()
        self._calls: set[_InFlight] = set()  # the `generate` calls running

    @property
    def pushes_weights(self) -> bool:
        """Whether `update_weights` reaches any server (a trainer rank dealt none draws the gather only)."""
        return bool(self._push_servers)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self._servers]

    def wait_until_ready(self) -> None:
        """Poll /health_generate until every server (and the router: once it has a worker) answers 200,
        or raise TimeoutError naming the laggard."""
        deadline = time.monotonic() + self.config.startup_timeout_s
        waiting = {url: "no answer yet" for url in self.urls + ([self._router.url] if self._router else [])}
        while waiting:
            for url in list(waiting):
                try:
                    timeout = max(1.0, min(10.0, deadline - time.monotonic()))
                    http_call(url, "/health_generate", method="GET", timeout=timeout)
                    del waiting[url]
                except (ServerError, *TRANSPORT_ERRORS) as error:
                    waiting[url] = f"{type(error).__name__}: {error}"
            if waiting and time.monotonic() >= deadline:
                url, last = next(iter(waiting.items()))
                raise TimeoutError(
                    f"SGLang server {url} was not healthy within {self.config.startup_timeout_s:.0f} s (last: {last}); "
                    "check that it was launched on that address and read its log"
                )
            if waiting:
                time.sleep(min(self.config.poll_interval_s, max(0.0, deadline - time.monotonic())))

    # ---------------------------------------------------------------- generation

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *, lora: str | None = None,
    ) -> list[Generation]:
        """`RolloutEngine.generate`; `lora` names the loaded LoRA adapter to sample with (`load_lora_adapter`), None
        the base."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if not prompts:
            return []
        # The router takes one prompt per request (per-prompt seeds need it); as many prompts stay in flight.
        step, per_request = (1, self.config.prompts_per_request) if self._router else (self.config.prompts_per_request, 1)
        chunks = [list(range(start, min(start + step, len(prompts)))) for start in range(0, len(prompts), step)]
        results: list[Generation | None] = [None] * len(prompts)
        workers = min(len(chunks), self.config.max_in_flight_per_server * per_request * len(self._servers))
        calls = _InFlight()
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sglang-generate")
        with self._calls_lock:
            self._calls.add(calls)
        try:
            futures = [pool.submit(self._generate_chunk, prompts, chunk, sampling, results, calls, lora)
                       for chunk in chunks]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        finally:  # after a failure (or an interrupt) nothing else is worth waiting for
            with self._calls_lock:
                self._calls.discard(calls)
            for urls, item_rids in calls.halt():
                self._abort(urls, item_rids)
            pool.shutdown(wait=False, cancel_futures=True)
        errors = [f.exception() for f in done if f.exception() is not None]
        if errors:
            finished = sum(r is not None for r in results)
            message = f"{errors[0]} ({finished}/{len(prompts)} prompts finished)"
            raise RolloutError(message, partial=results) from errors[0]
        return results  # type: ignore[return-value]  # every slot is filled when no chunk failed

    def _generate_chunk(
        self, prompts: Sequence[Sequence[int]], pending: list[int], sampling: SamplingParams,
        results: list[Generation | None], calls: _InFlight, lora: str | None,
    ) -> None:
        """Fill `results[i]` for every i in `pending`, re-sending failed requests and aborted prompts (once
        interrupted: partial generations instead, finish_reason "abort"); _Stopped once `calls` halted."""
        failures: list[str] = []
        avoid: str | None = None
        for attempt in range(self.config.max_retries + 1):
            if self._interrupted.is_set():  # nothing more is sent: the prompts not generated come back empty
                for i in pending:
                    results[i] = Generation(list(prompts[i]), [], [], "abort")
                return
            if attempt:
                if calls.stopped.wait(min(self.config.backoff_s * 2 ** (attempt - 1), self.config.max_backoff_s)):
                    raise _Stopped
                self.stats.add(retries=1)
            server = self._dispatcher.acquire(avoid)
            try:
                outputs = self._send_generate(server, [prompts[i] for i in pending], pending, sampling, calls, lora)
            except _ServerFailed as failure:
                failures.append(str(failure))
                avoid = server.url
                continue
            avoid = None
            interrupted = self._interrupted.is_set()
            for i, out in zip(pending, outputs):
                if not isinstance(out, proto.Aborted):
                    results[i] = out
                elif interrupted:
                    results[i] = out.partial
            pending = [i for i, out in zip(pending, outputs) if isinstance(out, proto.Aborted)]
            if not pending or interrupted:
                return
            self.stats.add(aborted_prompts=len(pending))
            failures.append(f"{server.url}: {len(pending)} prompts aborted")
        raise RolloutError(
            f"{len(pending)} prompts failed after {self.config.max_retries} retries: {'; '.join(failures[-3:])}; "
            "check the servers' logs, or raise max_retries / request_timeout_s"
        )

    def _send_generate(
        self, server: _Server, prompts: list[Sequence[int]], indices: list[int], sampling: SamplingParams,
        calls: _InFlight, lora: str | None,
    ) -> list[Generation | proto.Aborted]:
        """One /generate request (released to the dispatcher after). _ServerFailed when a retry may help."""
        rid = uuid.uuid4().hex
        routed = server is self._router  # one prompt, unbatched (see generate)
        routes = self.config.routed_experts_shape
        body = (proto.single_generate_request(prompts[0], sampling, index=indices[0], rid=rid,
                                              return_routed_experts=routes is not None, lora=lora) if routed
                else proto.generate_request(prompts, sampling, indices=indices, rid=rid,
                                            return_routed_experts=routes is not None, lora=lora))
        item_rids = [body["rid"]] if routed else body["rid"]
        abort_urls = self.urls if routed else [server.url]  # the router has no /abort_request
        self.stats.add(requests=1)
        failed = False
        try:
            with calls.sending(rid, abort_urls, item_rids):
                if self._interrupted.is_set():  # registered after `interrupt` looked: send nothing
                    return [proto.Aborted("interrupted", Generation(list(p), [], [], "abort")) for p in prompts]
                reply = http_call(server.url, "/generate", body, timeout=self.config.request_timeout_s)
            return proto.parse_generate_response(prompts, [reply] if routed else reply, routes)
        except ServerError as error:
            if error.status < 500:
                raise RolloutError(f"SGLang server {server.url} rejected /generate: {error}") from error
            failed = True
            raise _ServerFailed(str(error)) from error
        except TRANSPORT_ERRORS as error:
            failed = True
            if isinstance(error, TimeoutError):  # stop the orphan
                self._abort(abort_urls, item_rids)
            raise _ServerFailed(f"{server.url}/generate: {type(error).__name__}: {error}") from error
        except ValueError as error:
            raise RolloutError(f"SGLang server {server.url} sent a malformed /generate reply: {error}") from error
        finally:
            self._dispatcher.release(server, failed=failed)
            if failed:
                self.stats.add(failed_requests=1)

    def interrupt(self) -> None:
        """Abort this engine's requests in flight (/abort_request by rid: another client's stay): SGLang answers
        each item with the tokens generated so far, which `generate` returns as partial generations; until
        `end_interrupt` it sends nothing (what was not generated comes back empty, finish_reason "abort")."""
        self._interrupted.set()
        with self._calls_lock:
            requests = [request for calls in self._calls for request in calls.requests()]
        for urls, item_rids in requests:
            self._abort(urls, item_rids)

    def end_interrupt(self) -> None:
        self._interrupted.clear()

    @staticmethod
    def _abort(urls: list[str], item_rids: list[str]) -> None:
        """/abort_request for each item rid (SGLang ignores a rid that names no request, such as a batch's
        own) on each url, best-effort: a server that cannot be reached is skipped."""
        for url in urls:
            for rid in item_rids:
                try:
                    http_call(url, "/abort_request", proto.abort_request(rid), timeout=5.0)
                except ServerError:
                    continue
                except TRANSPORT_ERRORS:
                    break

    # ---------------------------------------------------------------- weights and control

    shared_across_ranks = True

    def metrics(self) -> dict[str, float]:
        return self.stats.as_metrics()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Push HF-named tensors to the push servers (`push_urls`) the way slime does: pause generation (abort
        mode), flush, push in buckets of `bucket_bytes` by `config.weight_sync`, continue. `named_tensors` is
        drawn lazily, bucket by bucket as the push goes (a gather runs alongside it). The push ends with a
        flush and weight_version n on the n-th successful push. Whatever fails, every push server is asked to
        continue; if that fails too, it is noted on the error raised.

        A push server that cannot be reached (refused, reset, timed out: dead) is left out of the push and named by
        `missed_push` (the trainer retires it from generation on every rank, `retire_servers`); one that answers
        again (restarted) joins the next push, after the transport's state is reset, and serves again once that
        push reached it."""

        def push(named: Iterable[tuple[str, torch.Tensor]]) -> None:
            self._on_push_servers("/flush_cache", lambda s: None, call=self._flush_one)
            self._transport.push(named, str(self._weight_version + 1))
            self._weight_version += 1

        self._while_paused(named_tensors, push)

    def load_lora_adapter(self, name: str, config: dict, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (or replace) LoRA adapter `name` on the push servers as SGLang takes one from tensors: generation
        paused as for `update_weights` (the servers it cannot reach are missed the same way), /unload_lora_adapter
        of any adapter of that name (SGLang refuses to load a name it holds; a fresh or restarted server holds none,
        and its refusal is ignored), then /load_lora_adapter_from_tensors. The tensors travel as shared-memory /
        CUDA-IPC handles (`proto.tensor_payload`, staged in one fresh buffer), so the servers must run on this host.
        `named_tensors` is drawn whole first, on every rank (the gather beside it is collective)."""
        tensors = list(named_tensors)
        elsewhere = [server.url for server in self._push_servers if not on_this_host(server.url)]
        if elsewhere:
            raise RolloutError(f"LoRA adapters load from tensors as shared-memory handles, which only a server on this "
                               f"host can open, but {', '.join(elsewhere)} is not on this host: set "
                               f"model.lora.weight_sync merged")

        def load(named: list[tuple[str, torch.Tensor]]) -> None:
            payload = proto.tensor_payload(named, None)
            self._try_servers(self._live_push_servers, "/unload_lora_adapter",
                              lambda s: proto.unload_lora_adapter_request(name))
            self._on_push_servers("/load_lora_adapter_from_tensors",
                                  lambda s: proto.load_lora_adapter_from_tensors_request(name, config, payload))

        self._while_paused(tensors, load)

    def load_lora_adapter_from_path(self, name: str, path: str) -> None:
        """Load (or replace) LoRA adapter `name` on the push servers from the PEFT directory at `path`, which they
        read from a filesystem they share with this process (model.lora.push_dir; any host): generation paused and
        any adapter of that name unloaded as for `load_lora_adapter`, then SGLang's /load_lora_adapter."""

        def load(_: list[tuple[str, torch.Tensor]]) -> None:
            self._try_servers(self._live_push_servers, "/unload_lora_adapter",
                              lambda s: proto.unload_lora_adapter_request(name))
            self._on_push_servers("/load_lora_adapter", lambda s: proto.load_lora_adapter_request(name, path))

        self._while_paused([], load)

    def _while_paused(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                      send: Callable[[Iterable[tuple[str, torch.Tensor]]], None]) -> None:
        """`send(named_tensors)` to the push servers that answer /pause_generation, then /continue_generation on
        them whatever happens; with none reachable, `named_tensors` is drawn all the same (a collective gather may
        run beside it). A changed set of live push servers (or a restarted one) resets the transport's state."""
        try:
            live = self._pause_reachable_push_servers()
            if [s.url for s in live] != [s.url for s in self._live_push_servers] or self._servers_restarted(live):
                self._live_push_servers[:] = live  # the transport pushes to these
                self._transport.close()  # a restarted server lost the transport's state (its weight-update group)
            if not live:
                for _ in named_tensors:  # the gather beside the push is collective: draw it all the same
                    pass
                return
            send(named_tensors)
        except BaseException as error:
            self._continue_generation(noting=error)
            raise
        self._continue_generation()

    def _pause_reachable_push_servers(self) -> list[_Server]:
        """/pause_generation on every push server; the ones that answered. A server that answers with an error
        fails the push (RolloutError); one that cannot be reached is skipped with a warning."""
        failures = self._try_servers(self._push_servers, "/pause_generation",
                                     lambda s: proto.pause_generation_request("abort"))
        refused = {url: error for url, error in failures.items() if not isinstance(error, TRANSPORT_ERRORS)}
        if refused:
            raise RolloutError(_failure_message("/pause_generation", refused, len(self._push_servers)))
        for url, error in failures.items():
            log.warning("weight push: %s cannot be reached (%s: %s); pushing to the other servers, and it generates "
                        "nothing until a push reaches it again", url, type(error).__name__, error)
        return [server for server in self._push_servers if server.url not in failures]

    def missed_push(self) -> set[str]:
        """The push servers this engine's last push did not reach."""
        return {s.url for s in self._push_servers} - {s.url for s in self._live_push_servers}

    def retire_servers(self, urls: set[str]) -> None:
        """Generate only on servers not in `urls` (those that missed a push on any rank; every other one is back in
        service)."""
        self._dispatcher.retired = set(urls)

    def _continue_generation(self, noting: BaseException | None = None) -> None:
        """/continue_generation on every push server the push reached; a failure is raised, or only noted on `noting`
        (being raised)."""
        try:
            self._on_push_servers("/continue_generation", lambda s: proto.continue_generation_request())
        except RolloutError as error:
            if noting is None:
                raise
            noting.add_note(f"then {error}")

    def _servers_restarted(self, servers: Sequence[_Server]) -> bool:
        """True when, after a push by this engine, one of `servers` reports another weight_version (or none): it
        was restarted (launch/servers.py `restart_dead`), or another client pushed."""
        if not self._weight_version:
            return False
        return any(server_weight_version(server.url, self.config.health_timeout_s) != str(self._weight_version)
                   for server in servers)

    def close(self) -> None:
        """Release server-side weight-sync state (the distributed group); the engine stays usable."""
        self._transport.close()

    def release_transfer_buffers(self) -> None:
        self._transport.release_buffers()

    def update_weights_from_disk(self, model_path: str) -> None:
        """Every server reloads its weights from the HF checkpoint at `model_path` (a path the servers can read)."""
        self._on_every_server("/update_weights_from_disk", lambda s: proto.update_weights_from_disk_request(model_path))

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free GPU memory (tags in weights/kv_cache/cuda_graph; None = all). Needs --enable-memory-saver."""
        body = proto.memory_occupation_request(tags)
        self._on_every_server("/release_memory_occupation", lambda s: body)

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        body = proto.memory_occupation_request(tags)
        self._on_every_server("/resume_memory_occupation", lambda s: body)

    def keeps_weights_across_release(self) -> bool:
        """Whether every server's weights keep their values across a memory release (started with
        --enable-weights-cpu-backup, as its /server_info says); without it they must be pushed again."""
        return all(http_call(s.url, "/server_info", method="GET").get("enable_weights_cpu_backup") for s in self._servers)

    def flush_cache(self) -> None:
        """Flush every server's cache, re-asking while it answers 400 (requests still in flight)."""
        self._on_every_server("/flush_cache", lambda s: None, call=self._flush_one)

    def _flush_one(self, url: str, path: str, body: Any, timeout: float) -> Any:
        for attempt in range(self.config.flush_attempts):
            try:
                return http_call(url, path, body, timeout=timeout)
            except ServerError as error:
                if error.status != 400 or attempt == self.config.flush_attempts - 1:
                    raise
            time.sleep(self.config.flush_interval_s)

    def health(self) -> bool:
        """True when at least one server answers /health_generate with 200 (the dispatcher routes around the rest)."""
        for server in self._servers:
            try:
                http_call(server.url, "/health_generate", method="GET", timeout=self.config.health_timeout_s)
                return True
            except (ServerError, *TRANSPORT_ERRORS):
                continue
        return False

    def _on_every_server(
        self, path: str, body_for: Callable[[_Server], Any], call: Callable[..., Any] = http_call
    ) -> None:
        """POST `path` to all servers in parallel; raise one error naming every server that failed."""
        self._on_servers(self._servers, path, body_for, call)

    def _on_push_servers(
        self, path: str, body_for: Callable[[_Server], Any], call: Callable[..., Any] = http_call
    ) -> None:
        """`_on_every_server` for the push servers the last push reached (all of them until one is lost)."""
        self._on_servers(self._live_push_servers, path, body_for, call)

    def _on_servers(
        self, servers: Sequence[_Server], path: str, body_for: Callable[[_Server], Any], call: Callable[..., Any]
    ) -> None:
        failures = self._try_servers(servers, path, body_for, call)
        if failures:
            raise RolloutError(_failure_message(path, failures, len(servers)))

    def _try_servers(
        self, servers: Sequence[_Server], path: str, body_for: Callable[[_Server], Any],
        call: Callable[..., Any] = http_call,
    ) -> dict[str, Exception]:
        """POST `path` to `servers` in parallel; the error of each server that failed, by URL."""
        def one(server: _Server) -> Exception | None:
            try:
                call(server.url, path, body_for(server), timeout=self.config.request_timeout_s)
                return None
            except (ServerError, *TRANSPORT_ERRORS) as error:
                return error

        if not servers:
            return {}
        with ThreadPoolExecutor(max_workers=len(servers), thread_name_prefix="sglang-control") as pool:
            errors = list(pool.map(one, servers))
        return {server.url: error for server, error in zip(servers, errors) if error is not None}
