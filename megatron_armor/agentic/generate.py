"""The low-level async rollout API: `generate(token_ids, sampling)` on any `RolloutEngine`, token ids in and out.

`EngineGenerator` puts the synchronous engines (the in-process `LocalEngine`, the SGLang client) behind one awaitable
call per trajectory turn. Calls made while the engine is busy queue up; each of `workers` threads takes the queued
calls of one sampling setting (at most `max_batch`) and runs them as one `engine.generate` batch. Calls that differ
only in their seed (a trajectory's turns are seeded each: `driver.TurnSeeds`) share a batch, with a seed per prompt
(`SamplingParams.seeds`): each samples what it would alone. The in-process engine wants one worker and large batches
(it is not thread-safe, and a batch costs about what one prompt does); the SGLang client wants many workers and
batches of one (each call its own request, returned as soon as it is done).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from megatron_armor.rollout.base import GenerationFinish, RolloutEngine, SamplingParams


@dataclass(frozen=True)
class GenerateResult:
    """One turn's sample. token_ids: [R] int, the stop token included when one ended it; logprobs: [R] float, the
    engine's (`Generation.logprobs`); finish_reason: "stop", "length" or "abort"; versions: [R] int, the weight
    version that drew each token (`Generation.versions`: a `PausableEngine`'s, whose turns a weight push interrupts
    and continues under the new weights), or None when the engine tracks none."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: GenerationFinish
    versions: list[int] | None = None


class Generator(Protocol):
    """What a rollout function samples with (its context's `generate`)."""

    async def generate(self, token_ids: Sequence[int], sampling: SamplingParams) -> GenerateResult: ...


@dataclass
class _Call:
    token_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future


class EngineGenerator:
    """`Generator` over a `RolloutEngine` (module docstring); `close` ends its threads (not the engine)."""

    def __init__(self, engine: RolloutEngine, *, workers: int = 1, max_batch: int = 256) -> None:
        if workers < 1 or max_batch < 1:
            raise ValueError(f"workers and max_batch must be >= 1, got {workers} and {max_batch}")
        self.engine = engine
        self.max_batch = max_batch
        self._workers = workers
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="agentic-generate")
        self._queue: list[_Call] = []
        self._serving: set[asyncio.Task] = set()  # worker tasks running (held: the loop keeps only weak references)

    async def generate(self, token_ids: Sequence[int], sampling: SamplingParams) -> GenerateResult:
        if not token_ids:
            raise ValueError("generate needs at least one prompt token")
        if sampling.seeds is not None:
            raise ValueError("a call generates one prompt: give its seed as sampling.seed, not sampling.seeds")
        call = _Call(list(token_ids), sampling, asyncio.get_running_loop().create_future())
        self._queue.append(call)
        if len(self._serving) < self._workers:
            self._serving.add(asyncio.create_task(self._serve()))
        return await call.future

    async def _serve(self) -> None:
        try:
            await asyncio.sleep(0)  # the other trajectories' calls of this tick join the first batch
            while self._queue:
                await self._run(self._take_batch())
        finally:  # at once, not in a done callback: a call queued in between would find no worker
            self._serving.discard(asyncio.current_task())

    async def _run(self, batch: list[_Call]) -> None:
        sampling = batch[0].sampling
        if sampling.seed is not None:  # each call its own seed
            sampling = dataclasses.replace(sampling, seed=None, seeds=tuple(c.sampling.seed for c in batch))
        try:
            generations = await asyncio.get_running_loop().run_in_executor(
                self._pool, self.engine.generate, [c.token_ids for c in batch], sampling)
        except Exception as error:  # every caller of the batch gets the engine's error
            for call in batch:
                if not call.future.done():
                    call.future.set_exception(error)
            return
        for call, g in zip(batch, generations):
            if not call.future.done():
                call.future.set_result(GenerateResult(list(g.response_ids), list(g.logprobs), g.finish_reason,
                                                      None if g.versions is None else list(g.versions)))

    def _take_batch(self) -> list[_Call]:
        """Up to `max_batch` queued calls sharing the first one's sampling settings but for their seeds (in queue
        order); seeded calls batch with seeded ones only."""
        key = _batch_key(self._queue[0].sampling)
        batch = [c for c in self._queue if _batch_key(c.sampling) == key][:self.max_batch]
        taken = set(map(id, batch))
        self._queue = [c for c in self._queue if id(c) not in taken]
        return batch

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _batch_key(sampling: SamplingParams) -> tuple[SamplingParams, bool]:
    """What calls must share to go as one batch: their sampling settings but the seed, and whether they are seeded."""
    return dataclasses.replace(sampling, seed=None), sampling.seed is not None
