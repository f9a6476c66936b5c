"""Fixtures for the SGLang-schema tests: real `http_server` subprocesses on loopback, always killed, and
in-process servers (whose engine lock a test can hold)."""

from __future__ import annotations

import base64
import contextlib
import os
import pickle
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from launcher import Forked
from transformers import AutoModelForCausalLM

from megatron_armor.rollout.http_server import LocalSGLangServer
from megatron_armor.rollout.local_server import LocalServerState
from megatron_armor.rollout.sglang_engine import http_call
from megatron_armor.utils.net import free_port


@dataclass
class ServerProcess:
    url: str
    proc: Forked
    log: Path

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


@pytest.fixture(scope="module")
def start_server(tmp_path_factory):
    """start_server(model_dir, *args) -> ServerProcess running `python -m megatron_armor.rollout.http_server`
    (args: more of its flags) in a process forked from the suite's pre-imported zygote (tests/launcher.py: the
    server's own main, without ~5 s of imports per server; `armor serve-local` as a fresh interpreter is started by
    tests/agentic/test_engines.py and the launch tests).

    Every server a test module starts is killed when the module ends.
    """
    started: list[ServerProcess] = []
    logs = tmp_path_factory.mktemp("server-logs")

    def start(model_dir: Path, *args: str) -> ServerProcess:
        port = free_port()
        log = logs / f"server-{port}.log"
        proc = Forked(["-m", "megatron_armor.rollout.http_server", "--model", str(model_dir), "--port", str(port), *args],
                      log)
        started.append(ServerProcess(f"http://127.0.0.1:{port}", proc, log))
        return started[-1]

    yield start
    for server in started:
        server.proc.kill()
        server.proc.wait(timeout=30)


@dataclass
class StubState:
    """All that a LocalSGLangServer serving its own `routes` needs of its state."""

    host: str = "127.0.0.1"
    port: int = 0
    ready: bool = True


@pytest.fixture(scope="session")
def serving():
    """serving(model_dir, port=0, load=True): a context manager around a LocalSGLangServer on loopback,
    served by a thread and closed on exit. load=False: the model is not loaded yet (every endpoint
    answers 503 until `server.state.load()`). serving(routes={path: handler}): a stub with only those."""

    @contextlib.contextmanager
    def serve(model_dir=None, port: int = 0, *, load: bool = True, routes=None):
        state = StubState(port=port) if routes else LocalServerState(model_dir, host="127.0.0.1", port=port)
        server = LocalSGLangServer(state, routes)
        if load and not routes:
            state.load()
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield server
        finally:
            server.shutdown()
            server.server_close()

    return serve


@pytest.fixture(scope="session")
def teacher_logprobs():
    """teacher_logprobs(model_dir, prompt, response, temperature) -> [R] log_softmax(logits / T) of `response`
    after `prompt` from one unpadded HF forward (T = 0 counts as 1): an independent reference."""
    models: dict[str, torch.nn.Module] = {}

    @torch.no_grad()
    def logprobs(model_dir, prompt, response, temperature=1.0):
        key = str(model_dir)
        if key not in models:
            models[key] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        ids = torch.tensor([list(prompt) + list(response)])
        logits = models[key](input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [R, V]
        scaled = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        return scaled.gather(-1, torch.tensor(list(response))[:, None]).squeeze(-1)

    return logprobs


@pytest.fixture(scope="session")
def second_tiny_model(tmp_path_factory) -> Path:
    """A tiny qwen2 checkpoint with the same shapes as `tiny_model_factory("qwen2")` but other weights (seed 1)."""
    from megatron_armor.models.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen2-seed1"), arch="qwen2", seed=1)


@pytest.fixture
def wait_for_load():
    """wait_for_load(url, key) blocks until the server's /v1/loads reports `key` (e.g. num_running_reqs) > 0."""

    def wait(url: str, key: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while http_call(url, "/v1/loads", method="GET")["loads"][0][key] == 0:
            if time.monotonic() > deadline:
                raise AssertionError(f"{url} never reported {key} > 0 within {timeout} s")
            time.sleep(0.005)

    return wait


@pytest.fixture
def os_system_payload(tmp_path) -> tuple[str, Path]:
    """(base64 pickle that calls os.system to create a marker file when unpickled, the marker's path)."""
    marker = tmp_path / "pwned"

    class Hostile:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    return base64.b64encode(pickle.dumps([("x", Hostile())])).decode(), marker
