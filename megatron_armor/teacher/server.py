"""`armor serve-teacher`: a frozen Megatron model at its own TP x PP layout, scoring tokens over HTTP.

Megatron's `parallel_state` holds one layout per process, so a teacher whose layout differs from
the student's lives in its own processes and its own `torch.distributed` world: `tp x pp` ranks,
no data parallelism, started by torchrun (`armor serve-teacher`) or by the trainer
(teacher/launcher.py). Rank 0 serves SGLang's scoring form of
`/generate` (teacher/protocol.py) with the CPU server's HTTP plumbing (rollout/http_server.py):
an HTTP thread queues each request, rank 0's main thread broadcasts it to every teacher rank, all
ranks run the forward-only Megatron schedule (scoring/logprobs.py `compute_logprobs`), and the HTTP
thread replies with the last stage's logprobs. Requests are scored one after another.

Endpoints: /generate (scoring only), /health and /health_generate (a 2-token scoring through every
rank), /model_info (adds vocab_size and the layout), /server_info. 503 until the model is loaded.

Run: `armor serve-teacher --model DIR --tp N --pp M --port P` (or `python -m
megatron_armor.teacher.server ...` under torchrun).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import logging
import queue
import sys
import threading
from collections.abc import Callable, Sequence
from http import HTTPStatus
from typing import Any

import torch
import torch.distributed as dist

from megatron_armor.config import MicroBatchingConfig
from megatron_armor.convert.loading import PARAMS_DTYPES, load_gpt_model
from megatron_armor.data.types import Sample
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed
from megatron_armor.models.hf_config import ModelShape, load_model_shape
from megatron_armor.rollout.http_server import LocalSGLangServer
from megatron_armor.rollout.local_server import RequestError
from megatron_armor.scoring.batch import build_sequence_batch
from megatron_armor.scoring.logprobs import ScoringConfig, compute_logprobs
from megatron_armor.scoring.micro_batches import MicroBatching
from megatron_armor.teacher.protocol import ScoreRequest, parse_score_request, score_item_body
from megatron_armor.teacher.serve_cli import TeacherServerConfig, add_serve_teacher_arguments, settings_from_args

log = logging.getLogger(__name__)

HEARTBEAT_S = 60.0  # an idle rank 0 wakes the other ranks this often (gloo collectives time out after 30 min)
HEALTH_TIMEOUT_S = 20.0  # as SGLang's SGLANG_HEALTH_CHECK_TIMEOUT
SERVER_VERSION = "megatron-armor-teacher"


def score_sequences(model: torch.nn.Module, request: ScoreRequest, micro_batch_size: int) -> list[list[float]]:
    """Collective over the teacher ranks: per sequence [L - 1] logprobs of its tokens 1..L-1 (fp32), in
    micro-batches of `micro_batch_size` sequences."""
    sequences = request.sequences
    batch = build_sequence_batch([_scored_sample(seq) for seq in sequences], [0.0] * len(sequences), pad_token_id=0)
    batching = MicroBatching(MicroBatchingConfig(micro_batch_size))
    logprobs = compute_logprobs(
        model, batch, micro_batching=batching, scoring=ScoringConfig(temperature=request.temperature)
    ).logprobs  # [B, S] label aligned: column t scores token t + 1
    return [logprobs[row, : len(seq) - 1].tolist() for row, seq in enumerate(sequences)]


def _scored_sample(sequence: list[int]) -> Sample:
    """A sequence as a `Sample` whose "response" is every token after the first (all of them scored)."""
    return Sample(prompt_index=0, prompt_ids=sequence[:1], response_ids=sequence[1:],
                  engine_logprobs=[0.0] * (len(sequence) - 1), finish_reason="length", is_anchor=False)


class TeacherServerState:
    """Rank 0's side of the server: what the HTTP threads see, and the queue into the scoring loop."""

    def __init__(self, settings: TeacherServerConfig) -> None:
        self.settings = settings
        self.host, self.port = settings.host, settings.port
        self.shape: ModelShape | None = None  # set once every rank has loaded the model
        self.failure: str | None = None
        self._jobs: queue.Queue[tuple[ScoreRequest, concurrent.futures.Future]] = queue.Queue()
        self._item_ids = itertools.count()  # rids of output items

    @property
    def ready(self) -> bool:
        return self.shape is not None

    def score(self, request: ScoreRequest, timeout: float | None = None) -> list[list[float]]:
        """Queue `request` for the scoring loop and wait for its logprobs."""
        if self.failure is not None:
            raise RequestError(f"the teacher ranks failed: {self.failure}", HTTPStatus.SERVICE_UNAVAILABLE)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((request, future))
        return future.result(timeout)

    def next_job(self, timeout: float) -> tuple[ScoreRequest, concurrent.futures.Future] | None:
        try:
            return self._jobs.get(timeout=timeout)
        except queue.Empty:
            return None

    def fail(self, error: BaseException) -> None:
        """The scoring loop is gone: fail every queued request and refuse new ones."""
        self.failure = f"{type(error).__name__}: {error}"
        while (job := self.next_job(0)) is not None:
            job[1].set_exception(RuntimeError(self.failure))

    def routes(self) -> dict[str, Callable[[dict[str, Any]], Any]]:
        """Path -> handler(body), as `LocalSGLangServer` dispatches them."""
        return {
            "/generate": self.generate, "/health": self.health, "/health_generate": self.health,
            "/model_info": self.model_info, "/get_model_info": self.model_info,
            "/server_info": self.server_info, "/get_server_info": self.server_info,
        }

    def generate(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        request = parse_score_request(body, self.shape.vocab_size)
        scores = self.score(request)
        return [score_item_body(seq, lps, f"teacher-{next(self._item_ids)}", "default")
                for seq, lps in zip(request.sequences, scores)]

    def health(self, _: dict[str, Any]) -> None:
        try:
            self.score(ScoreRequest([[0, 0]], 1.0), timeout=HEALTH_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise RequestError(f"health check: no scoring within {HEALTH_TIMEOUT_S:.0f} s",
                               HTTPStatus.SERVICE_UNAVAILABLE) from None

    def model_info(self, _: dict[str, Any]) -> dict[str, Any]:
        s = self.settings
        return {"model_path": s.model_path, "is_generation": True, "weight_version": "default",
                "architectures": [self.shape.arch], "vocab_size": self.shape.vocab_size,
                "tensor_parallel_size": s.tensor_parallel_size, "pipeline_parallel_size": s.pipeline_parallel_size}

    def server_info(self, _: dict[str, Any]) -> dict[str, Any]:
        s = self.settings
        return {"model_path": s.model_path, "tp_size": s.tensor_parallel_size, "pp_size": s.pipeline_parallel_size,
                "dp_size": 1, "version": SERVER_VERSION}


def serve_teacher(settings: TeacherServerConfig) -> int:
    """Entry point on every teacher rank (under torchrun); returns the exit code."""
    ctx = initialize_distributed(settings.tensor_parallel_size, settings.pipeline_parallel_size, 1)
    state = TeacherServerState(settings) if ctx.is_main else None
    http = LocalSGLangServer(state, routes=state.routes()) if state is not None else None
    if http is not None:
        threading.Thread(target=http.serve_forever, daemon=True).start()  # 503 until the model is loaded
    try:
        shape = load_model_shape(settings.model_path)
        model = load_gpt_model(settings.model_path, shape, params_dtype=PARAMS_DTYPES[settings.params_dtype])
        dist.barrier()
        if state is not None:
            state.shape = shape
            log.warning("teacher %s (tp %d x pp %d) serving at http://%s:%d", settings.model_path,
                        ctx.tp_size, ctx.pp_size, settings.host, state.port)
        _scoring_loop(model, state, settings.micro_batch_size)
    except Exception as error:  # name the rank; torchrun then stops the others
        log.error("teacher rank %d (tp %d, pp %d) failed: %s: %s", ctx.rank, ctx.tp_rank, ctx.pp_rank,
                  type(error).__name__, error, exc_info=True)
        if state is not None:
            state.fail(error)
        return 1
    finally:
        if http is not None:
            http.shutdown()
            http.server_close()
        destroy_distributed()


def _scoring_loop(model: torch.nn.Module, state: TeacherServerState | None, micro_batch_size: int) -> None:
    """Forever: rank 0 broadcasts the next request (None: an idle heartbeat), every rank scores it."""
    while True:
        job = state.next_job(HEARTBEAT_S) if state is not None else None
        message = [job[0] if job is not None else None]
        dist.broadcast_object_list(message, src=0)
        if message[0] is None:
            continue
        try:
            scores = score_sequences(model, message[0], micro_batch_size)
        except Exception as error:
            if job is not None:
                job[1].set_exception(error)
            raise
        if job is not None:
            job[1].set_result(scores)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m megatron_armor.teacher.server ...` on one teacher rank (RANK, WORLD_SIZE, MASTER_* set)."""
    parser = add_serve_teacher_arguments(argparse.ArgumentParser(prog="python -m megatron_armor.teacher.server"))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    return serve_teacher(settings_from_args(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
