"""How the OPD trainer gets teacher logprobs of the student's tokens: one interface, two ways.

- `InProcessTeacher`: a frozen GPTModel in the trainer's own processes, at the student's TP/PP.
- `RemoteTeacher`: scoring servers over SGLang's scoring form of /generate (teacher/protocol.py):
  our Megatron teacher at its own TP/PP (`armor serve-teacher`, or started by the trainer), or a
  real SGLang server. Within each model-parallel group (the student's TP x PP ranks holding one
  data-parallel shard) the first rank asks for its shard and broadcasts the answer, or the error,
  to the others, so every rank raises the same clear error instead of hanging in a collective.
  Asking per shard needs no gather of the data-parallel batches, and several servers (or DP
  shards) score in parallel.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_armor.models.hf_config import ModelConfigError
from megatron_armor.rollout.sglang_engine import TRANSPORT_ERRORS, ServerError, http_call
from megatron_armor.scoring.batch import SequenceBatch
from megatron_armor.scoring.logprobs import ScoringConfig, compute_logprobs
from megatron_armor.scoring.micro_batches import MicroBatching
from megatron_armor.teacher.launcher import TeacherError, TeacherServerGroup
from megatron_armor.teacher.protocol import ScoreRequest, parse_score_response, score_request_body
from megatron_armor.teacher.serve_cli import TeacherServerConfig

log = logging.getLogger(__name__)


def check_teacher_vocab(teacher_vocab: int, student_vocab: int, where: str) -> None:
    """OPD scores the student's tokens under the teacher, so both must use one vocabulary."""
    if teacher_vocab != student_vocab:
        raise ModelConfigError(
            f"the OPD teacher {where} has vocab_size {teacher_vocab}, the student has {student_vocab}; OPD scores the "
            f"student's tokens under the teacher, so they must share a vocabulary (pick a teacher of the same family)"
        )


class TeacherScorer(abc.ABC):
    """Teacher logprobs of a batch's labels; every trainer rank calls `score` with its own batch."""

    @abc.abstractmethod
    def score(self, batch: SequenceBatch) -> torch.Tensor:
        """Collective: [B, S] float32 label-aligned teacher logprobs, 0 off `batch.response_mask`."""

    def close(self) -> None:
        """Release what the scorer started (a teacher server); idempotent."""


class InProcessTeacher(TeacherScorer):
    """A frozen GPTModel sharded like the student (this process's `parallel_state` layout)."""

    def __init__(self, model: torch.nn.Module, *, micro_batching: MicroBatching, scoring: ScoringConfig) -> None:
        self.model, self.micro_batching, self.scoring = model, micro_batching, scoring

    def score(self, batch: SequenceBatch) -> torch.Tensor:
        return compute_logprobs(self.model, batch, micro_batching=self.micro_batching, scoring=self.scoring).logprobs


class TeacherClient:
    """HTTP client of teacher scoring servers; a batch is split into one contiguous chunk per server.

    `group`: the teacher server this process started, if any; its rank failures explain errors.
    """

    def __init__(self, urls: list[str], *, timeout_s: float = 600.0, group: TeacherServerGroup | None = None) -> None:
        if not urls:
            raise ValueError("TeacherClient needs at least one teacher server URL")
        self.urls, self.timeout_s, self.group = [u.rstrip("/") for u in urls], timeout_s, group

    def model_info(self) -> list[dict[str, Any]]:
        """Every server's /model_info (our server adds vocab_size and its layout)."""
        return [self._call(url, "/model_info", None, method="GET") for url in self.urls]

    def check_vocab(self, student_vocab: int) -> None:
        """Compare each server's vocab_size with the student's (servers that do not report one are logged)."""
        for url, info in zip(self.urls, self.model_info()):
            if "vocab_size" in info:
                check_teacher_vocab(int(info["vocab_size"]), student_vocab, f"at {url} ({info.get('model_path')})")
            else:
                log.warning("teacher server %s does not report vocab_size; make sure it matches the student's (%d)",
                            url, student_vocab)

    def score(self, request: ScoreRequest) -> list[list[float]]:
        """Per sequence [L - 1] logprobs of tokens 1..L-1 at `request.temperature`."""
        n = len(self.urls)
        size = -(-len(request.sequences) // n)
        chunks = [request.sequences[i * size : (i + 1) * size] for i in range(n)]
        jobs = [(url, chunk) for url, chunk in zip(self.urls, chunks) if chunk]

        def ask(url: str, chunk: list[list[int]]) -> list[list[float]]:
            body = self._call(url, "/generate", score_request_body(ScoreRequest(chunk, request.temperature)))
            try:
                return parse_score_response(chunk, body)
            except (ValueError, KeyError, TypeError, IndexError) as error:
                raise TeacherError(f"teacher server {url}: malformed scoring reply: {error}") from error

        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            parts = list(pool.map(lambda job: ask(*job), jobs))
        return [scores for part in parts for scores in part]

    def close(self) -> None:
        if self.group is not None:
            self.group.stop()

    def _call(self, url: str, path: str, body: Any, *, method: str = "POST") -> Any:
        try:
            return http_call(url, path, body, method=method, timeout=self.timeout_s)
        except (ServerError, *TRANSPORT_ERRORS) as error:
            server_side = not isinstance(error, ServerError) or error.status >= 500  # not a refused request
            report = self.group.wait_failure(timeout_s=30.0) if self.group is not None and server_side else None
            if report is not None:
                raise TeacherError(f"{path} to the teacher failed ({type(error).__name__}: {error}):\n{report}") from error
            raise TeacherError(f"teacher server {url}{path} failed: {type(error).__name__}: {error}; check that the "
                               f"server runs and its log (opd.teacher_url)") from error


class RemoteTeacher(TeacherScorer):
    """Teacher logprobs from scoring servers; one request per model-parallel group and step."""

    def __init__(self, client: TeacherClient, *, temperature: float) -> None:
        self.client, self.temperature = client, temperature

    def score(self, batch: SequenceBatch) -> torch.Tensor:
        host = batch.to(torch.device("cpu"))  # the answer crosses the object broadcast as a CPU tensor
        scores = on_first_rank(lambda: self._fetch(host), parallel_state.get_model_parallel_group())
        return scores.to(batch.response_mask.device)

    def _fetch(self, batch: SequenceBatch) -> torch.Tensor:
        """Score every row (of a CPU batch) up to its last response token; rows without response tokens stay 0."""
        scores = torch.zeros(batch.input_ids.shape, dtype=torch.float32)  # [B, S]
        rows, sequences = [], []
        for row in range(batch.size):
            positions = batch.response_mask[row].nonzero()
            if len(positions):
                rows.append(row)
                sequences.append(batch.input_ids[row, : int(positions[-1]) + 2].tolist())  # label t is token t + 1
        if sequences:
            for row, logprobs in zip(rows, self.client.score(ScoreRequest(sequences, self.temperature))):
                scores[row, : len(logprobs)] = torch.tensor(logprobs)
        return scores * batch.response_mask

    def close(self) -> None:
        self.client.close()


def on_first_rank(fn: Callable[[], Any], group: dist.ProcessGroup | None = None) -> Any:
    """Collective over `group` (default: world): run `fn` on its first rank, share the result with all.

    Whatever `fn` raises is raised on every rank of the group, so none waits for a result that never
    comes: a `ModelConfigError` as itself, anything else as a `TeacherError` naming the original (on
    the first rank chained to it).
    """
    result: list[Any] = [None]
    failure: Exception | None = None
    if dist.get_rank(group) == 0:
        try:
            result[0] = ("ok", fn())
        except Exception as error:  # noqa: BLE001 - every rank must learn of any failure
            failure = error
            message = str(error) if isinstance(error, (TeacherError, ModelConfigError)) else f"{type(error).__name__}: {error}"
            result[0] = ("ModelConfigError" if isinstance(error, ModelConfigError) else "TeacherError", message)
    dist.broadcast_object_list(result, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    kind, value = result[0]
    if kind == "ok":
        return value
    raise (ModelConfigError if kind == "ModelConfigError" else TeacherError)(value) from failure


def connect_remote_teacher(
    urls: list[str] | None, *, student_vocab: int, temperature: float, launch: TeacherServerConfig | None = None,
    log_dir: str | Path = ".",
) -> RemoteTeacher:
    """Collective over the trainer's ranks: a `RemoteTeacher` of running servers (`urls`), or of a
    server that global rank 0 starts from `launch` (logs in `log_dir`) and stops on `close()`.

    Checks the servers' vocabulary against the student's; raises TeacherError / ModelConfigError on every rank.
    """
    group = None
    if launch is not None:
        group = TeacherServerGroup(launch, log_dir=log_dir) if dist.get_rank() == 0 else None
        urls = [on_first_rank(lambda: _healthy(group))]
    client = TeacherClient(urls, group=group)
    try:
        on_first_rank(lambda: client.check_vocab(student_vocab))
    except (TeacherError, ModelConfigError):
        client.close()
        raise
    return RemoteTeacher(client, temperature=temperature)


def _healthy(group: TeacherServerGroup) -> str:
    """Wait for a started server; stop its ranks if it does not come up."""
    try:
        return group.wait_healthy()
    except TeacherError:
        group.stop()
        raise
