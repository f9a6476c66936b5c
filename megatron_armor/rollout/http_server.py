"""A `LocalEngine` behind SGLang's HTTP schema, so the SGLang client can be tested without SGLang (on
the CPU, or on a GPU with `--device cuda`).

Same paths, fields and logprob layout as SGLang 0.5.15 with --skip-tokenizer-init (input_ids in,
no text out); the endpoint logic lives in `local_server.LocalServerState`. The port is bound first
and every endpoint answers 503 until the model is loaded. Stdlib only (`ThreadingHTTPServer`).

Run: `python -m megatron_armor.rollout.http_server --model DIR --port N` (or `armor serve-local`).
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from megatron_armor.rollout import sglang_protocol as proto
from megatron_armor.rollout.local_server import LocalServerState, RequestError
from megatron_armor.rollout.serve_cli import add_serve_local_arguments
from megatron_armor.rollout.tensor_serialization import NamedTensors, PayloadError

log = logging.getLogger(__name__)

FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


def _routes(state: LocalServerState) -> dict[str, Callable[[dict[str, Any]], Any]]:
    """Path -> handler(body) returning a JSON-able reply, a str (plain text) or None (empty 200)."""

    def flush(_: dict) -> str:
        state.require_idle("/flush_cache", "Cache not flushed because there are pending requests")
        return FLUSHED

    mapped = _MappedPayloads(state)

    def weights_from_tensor(body: dict) -> dict:
        try:
            named = proto.named_tensors_from_request(body, allow_cuda=state.device.type == "cuda")
        except PayloadError as error:
            raise RequestError(f"/update_weights_from_tensor: bad payload: {error}") from error
        reply = state.update_weights(named, body)
        mapped.loaded(named)
        return reply

    def health(_: dict) -> None:
        state.health_generate()

    return {
        "/health": health, "/health_generate": health,
        "/model_info": lambda _: state.model_info(), "/get_model_info": lambda _: state.model_info(),
        "/server_info": lambda _: state.server_info(), "/get_server_info": lambda _: state.server_info(),
        "/v1/loads": lambda _: state.loads(),
        "/generate": state.generate, "/abort_request": state.abort, "/flush_cache": flush,
        "/update_weights_from_tensor": weights_from_tensor,
        "/update_weights_from_disk": state.update_weights_from_disk,
        "/init_weights_update_group": state.init_weights_update_group,
        "/update_weights_from_distributed": state.update_weights_from_distributed,
        "/destroy_weights_update_group": state.destroy_weights_update_group,
        "/update_weight_version": state.update_weight_version,
        "/pause_generation": state.pause_generation, "/continue_generation": state.continue_generation,
        "/get_weights_by_name": state.weights_by_name,
        "/load_lora_adapter_from_tensors": state.load_lora_adapter, "/unload_lora_adapter": state.unload_lora_adapter,
        "/load_lora_adapter": state.load_lora_adapter_from_path,
        "/release_memory_occupation": state.release_memory, "/resume_memory_occupation": state.resume_memory,
    }


class _MappedPayloads:
    """A CPU server keeps the shared-memory storages it loaded from mapped, most recent first, up to twice
    its model's bytes (the actor's and the reference's weights of a shared engine, or two staging buffers).
    A sender that reuses its storages then sends the same handles, which torch resolves from its cache
    instead of mapping the segment, and faulting in every page, again: that costs about as much as the copy
    itself. Holding them costs no memory while the sender keeps them, and at most that budget after it
    frees them. A GPU server drops each payload at once, as SGLang does: its CUDA-IPC handles would keep
    the sender's GPU buffers from being freed or reused."""

    def __init__(self, state: LocalServerState) -> None:
        self.state = state
        self.storages: OrderedDict[int, torch.UntypedStorage] = OrderedDict()  # data_ptr -> storage, oldest first
        self._budget: int | None = None  # bytes; 2 x the model's weights, counted at the first payload
        self._lock = threading.Lock()

    def loaded(self, named: NamedTensors) -> None:
        """Keep the shared storages of one loaded payload; drop the oldest others beyond the budget."""
        if self.state.device.type != "cpu":
            return
        latest = {s.data_ptr(): s for s in (t.untyped_storage() for _, t in named) if s.is_shared()}
        if self._budget is None:
            self._budget = 2 * sum(p.nbytes for p in self.state.engine.model.parameters())
        with self._lock:
            for address, storage in latest.items():
                self.storages[address] = storage
                self.storages.move_to_end(address)
            held = sum(storage.nbytes() for storage in self.storages.values())
            while held > self._budget and next(iter(self.storages)) not in latest:
                held -= self.storages.popitem(last=False)[1].nbytes()


class _Handler(BaseHTTPRequestHandler):
    server: LocalSGLangServer

    def do_GET(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _handle(self) -> None:
        path = self.path.split("?", 1)[0]
        route = self.server.routes.get(path)
        if route is None:
            return self._error(HTTPStatus.NOT_FOUND, f"no endpoint {path}")
        if not self.server.state.ready:
            return self._error(HTTPStatus.SERVICE_UNAVAILABLE, f"{path}: the server is still loading the model")
        try:
            length = int(self.headers.get("Content-Length") or 0)
            result = route(json.loads(self.rfile.read(length)) if length else {})
        except RequestError as error:
            return self._error(error.status, str(error))
        except (ValueError, KeyError, TypeError, OSError) as error:
            return self._error(HTTPStatus.BAD_REQUEST, f"{path}: {type(error).__name__}: {error}")
        except Exception as error:
            log.exception("%s failed", path)
            message = f"{path}: internal error {type(error).__name__}: {error}"
            return self._error(HTTPStatus.INTERNAL_SERVER_ERROR, message)
        self._reply(HTTPStatus.OK, result)

    def _error(self, status: int, message: str) -> None:
        """SGLang's error shapes at once: {"error": {"message"}} (/generate) and {"success", "message"} (control)."""
        self._reply(status, {"success": False, "message": message, "error": {"message": message}})

    def _reply(self, status: int, result: Any) -> None:
        if result is None:
            data, kind = b"", "application/json"
        elif isinstance(result, str):
            data, kind = result.encode(), "text/plain; charset=utf-8"
        else:
            data, kind = json.dumps(result).encode(), "application/json"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class LocalSGLangServer(ThreadingHTTPServer):
    """ThreadingHTTPServer bound to `state`; call `state.load()` (or `serve_local`) to become ready.

    `routes` (default: the CPU engine's endpoints) lets another backend serve its own endpoints with
    the same plumbing; its `state` then needs only `host`, `port` and `ready`.
    """

    daemon_threads = True
    # The listen backlog. socketserver's default of 5 drops the SYNs of a burst of connections (a router
    # forwarding one request per prompt opens ~100 at once), and each dropped client waits out TCP's SYN
    # retransmissions (1 + 2 + 4 + 8 + 16 s) before its request fails and is retried. SGLang's own server
    # (uvicorn) listens with a backlog of 2048; so does this one (the kernel caps it at net.core.somaxconn).
    request_queue_size = 2048

    def __init__(self, state: LocalServerState, routes: dict[str, Callable[[dict[str, Any]], Any]] | None = None) -> None:
        super().__init__((state.host, state.port), _Handler)
        state.port = self.server_address[1]
        self.state = state
        self.routes = _routes(state) if routes is None else routes


def serve_local(
    model_dir: str | Path, host: str = "127.0.0.1", port: int = 30000, *, random_seed: int = 0,
    weights_cpu_backup: bool = False, device: str = "cpu", return_routed_experts: bool = False,
) -> None:
    """Serve `model_dir` on `device` until interrupted: bind, answer 503 while loading, then serve."""
    server = LocalSGLangServer(LocalServerState(model_dir, host=host, port=port, random_seed=random_seed,
                                                weights_cpu_backup=weights_cpu_backup, device=device,
                                                return_routed_experts=return_routed_experts))
    failure: list[BaseException] = []

    def load() -> None:
        try:
            server.state.load()
            log.warning("serving %s at http://%s:%d", model_dir, host, server.state.port)
        except BaseException as error:  # reported by serve_local once serve_forever returns
            failure.append(error)
            server.shutdown()

    threading.Thread(target=load, daemon=True).start()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    if failure:
        raise RuntimeError(f"serve-local: could not load the model from {model_dir}") from failure[0]


def run_serve_local(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    serve_local(args.model, host=args.host, port=args.port, random_seed=args.random_seed,
                weights_cpu_backup=args.enable_weights_cpu_backup, device=args.device,
                return_routed_experts=args.enable_return_routed_experts)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m megatron_armor.rollout.http_server --model DIR --port N`."""
    parser = add_serve_local_arguments(argparse.ArgumentParser(prog="python -m megatron_armor.rollout.http_server"))
    return run_serve_local(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
