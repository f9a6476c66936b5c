"""ARMOR's anchors sampled ahead of the generation batches that use them (the overlapped rollout modes).

The reference is frozen between resets, and a generation batch's anchors are seeded by the sampler position its
prompts are drawn at (`AnchorSource.seed`), so they can be sampled before the batch is. In rollout.mode one_step_off
and async, with a reference engine of its own, the anchor source (trainer/rollouts/anchors.py) has them sampled on a
thread of their own (its collectives over a gloo group of its own): each generation batch submits its own anchors and
those of the `depth` batches the sampler draws next (`submit_ahead`: a twin of the prompt sampler, `PromptSampler.at`,
draws their prompts), and takes its own once its on-policy samples are drawn. So the reference's engine samples while
the actor's does, and ahead of it: a batch waits for its anchors only when the reference's engine falls behind, and in
async a weight push waits only for the actor's part of a batch (trainer/rollouts/async_rollouts.py). The sampler's
draws do not depend on RL steps, so anchors sampled ahead serve whichever step draws those prompts (one_step_off's
next rollout, async's next batches).

Every rank submits the same jobs in the same order (the positions are the same on every rank), so every rank's thread
makes the same collective calls. `reset` (a reference reset or the anchor action: the queued anchors came from the old
reference) and `drain` (the run's end, and before a checkpoint reads the anchor cache) wait until the jobs submitted
are done. A failure of the thread is raised by every later call. Anchors sampled ahead are not checkpointed: a resumed
run samples them again, with the same seeds.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist

from megatron_armor.data.datasets import PromptRow, PromptSampler
from megatron_armor.data.types import Sample
from megatron_armor.trainer.rollouts.samples import RolloutCounters, draw_prompts


class AnchorSampler(Protocol):
    """The anchor source the thread samples from (trainer/rollouts/anchors.py `AnchorSource`): the seed of the anchors
    of the generation batch drawn at a sampler position, and how it samples them."""

    def seed(self, position: dict[str, Any]) -> tuple: ...

    def sample(
        self, prompts: list[PromptRow], seed: tuple, counters: RolloutCounters, *, group: dist.ProcessGroup | None,
    ) -> list[Sample]: ...


def _key(position: dict[str, Any]) -> tuple:
    """The key of the generation batch drawn at sampler `position`."""
    return tuple(position.values())


@dataclass(frozen=True)
class _Job:
    """One generation batch's anchors to sample: its key (`_key`), prompts and seed."""

    key: tuple
    prompts: list[PromptRow]
    seed: tuple

    @property
    def prompt_ids(self) -> list[list[int]]:
        return [prompt.prompt_ids for prompt in self.prompts]


class AnchorPrefetch:
    """The anchors of generation batches, sampled from `source` in submission order by a daemon thread whose
    collectives run over `group` (None: the default group, or no torch.distributed), up to `depth` batches ahead of the
    one in use. A batch is named by the sampler position its prompts are drawn at."""

    def __init__(self, source: AnchorSampler, group: dist.ProcessGroup | None, depth: int) -> None:
        self.source, self.group, self.depth = source, group, depth
        self._cond = threading.Condition()
        self._jobs: collections.deque[_Job] = collections.deque()
        self._submitted: dict[tuple, list[list[int]]] = {}  # keys submitted and not yet taken -> their prompts
        self._ready: dict[tuple, tuple[list[Sample], RolloutCounters]] = {}
        self._busy = False  # the thread is sampling a job
        self._ahead: PromptSampler | None = None  # at the first position not yet submitted
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def submit(self, position: dict[str, Any], prompts: list[PromptRow]) -> None:
        """Sample the anchors of the generation batch drawn at `position` (its `prompts`, seeded
        `source.seed(position)`) on the thread; nothing to do if it was submitted (ahead) already, for the same
        prompts (else RuntimeError: the batches drawn ahead are not the ones the generator draws)."""
        job = _Job(_key(position), prompts, self.source.seed(position))
        with self._cond:
            if job.key in self._submitted:
                if self._submitted[job.key] != job.prompt_ids:
                    raise RuntimeError(f"anchors of generation batch {position} were sampled ahead for other prompts")
                return
            self._submitted[job.key] = job.prompt_ids
            self._jobs.append(job)
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._sample, name="anchor-prefetch", daemon=True)
                self._thread.start()

    def submit_ahead(self, sampler: PromptSampler, position: dict[str, Any]) -> None:
        """Submit the anchors of the generation batches `sampler` (a twin of it) draws from `position` on: the one
        there and the `depth` after it, as far as they are not submitted yet."""
        with self._cond:
            if self._ahead is None or not self._submitted:  # the first batch, or nothing ahead: start at `position`
                self._ahead = sampler.at(position)
            while len(self._submitted) <= self.depth:
                self.submit(self._ahead.state_dict(), draw_prompts(self._ahead))

    def take(self, position: dict[str, Any], counters: RolloutCounters) -> list[Sample]:
        """The anchors of the generation batch drawn at `position` (submitted before), once sampled; the wait counts
        in `counters.anchor_seconds`, the thread's cache hits in `anchor_cache_hits`."""
        start = time.perf_counter()
        key = _key(position)
        with self._cond:
            if key not in self._submitted:
                raise RuntimeError(f"anchors of generation batch {position} were never submitted")
            self._cond.wait_for(lambda: key in self._ready or self._error is not None)
            self._raise_failure()
            anchors, own = self._ready.pop(key)
            del self._submitted[key]
        counters.anchor_cache_hits += own.anchor_cache_hits
        counters.anchor_seconds += time.perf_counter() - start
        return anchors

    def _sample(self) -> None:
        """The thread: sample the submitted jobs in order."""
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: bool(self._jobs))
                    job, self._busy = self._jobs.popleft(), True
                own = RolloutCounters()
                anchors = self.source.sample(job.prompts, job.seed, own, group=self.group)
                with self._cond:
                    self._ready[job.key], self._busy = (anchors, own), False
                    self._cond.notify_all()
        except BaseException as error:  # raised by every later `take`, `drain` and `reset`: the thread is gone
            with self._cond:
                self._error, self._busy = error, False
                self._cond.notify_all()

    def drain(self) -> None:
        """Wait until every job submitted is sampled."""
        with self._cond:
            self._cond.wait_for(lambda: not (self._jobs or self._busy) or self._error is not None)
            self._raise_failure()

    def reset(self) -> None:
        """Drop every anchor sampled ahead (after `drain`): later jobs start again from what is submitted next."""
        self.drain()
        with self._cond:
            self._ready.clear()
            self._submitted.clear()
            self._ahead = None

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"sampling anchors ahead failed: {self._error}") from self._error
