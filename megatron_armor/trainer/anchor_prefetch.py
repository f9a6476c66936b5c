"""ARMOR's anchors sampled ahead of the generation batches that use them (rollout.mode async).

The reference is frozen between resets, so the anchors of a generation batch do not depend on when they are sampled:
a thread of its own (its collectives over a gloo group of its own) samples the anchors of the batches the generator
will draw next, from a twin of the prompt sampler (`PromptSampler.at`), with the seeds the batch itself would use
(`RolloutPhase.seed` of the batch's key), while the actor's engine samples the batch. The generator then takes a
batch's anchors when it has its on-policy samples (`take`), waiting only if the reference's engine is behind. So
anchor generation never holds up a weight push (a push waits only for the actor's samples) and a batch costs the
longer of its two phases, not their sum.

How far ahead: `depth` batches beyond the last one taken. What is issued grows only with what `take` consumed, the same
on every rank, so every rank's thread makes the same collective calls; `reset` (a reference reset or the anchor
action: the queued anchors came from the old reference) and `drain` (the run's end) wait for what was issued, then
nothing more is issued until the next `take`, which happens after the reference's engine holds its new weights.
Prefetched anchors are not checkpointed: a resumed run samples them again from the sampler's position, with the same
seeds.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from megatron_armor.data.datasets import PromptSampler
from megatron_armor.data.types import Sample
from megatron_armor.trainer.rollout_phase import RolloutPhase
from megatron_armor.trainer.samples import RolloutCounters


class AnchorPrefetch:
    """The anchors of the generation batches to come, sampled by a daemon thread `depth` batches ahead.

    `phase`: the generator's rollout phase (its plan, engines, anchor cache and sampler); `group`: the process group
    of the thread's collectives (None: the default one, or no torch.distributed); `batch_key(position)`: the key of
    the generation batch drawn at sampler position `position` (its seeds derive from it).
    """

    def __init__(self, phase: RolloutPhase, depth: int, group: dist.ProcessGroup | None,
                 batch_key: Callable[[dict[str, Any]], tuple]) -> None:
        self.phase, self.depth, self.group, self.batch_key = phase, depth, group, batch_key
        self._cond = threading.Condition()
        self._ready: dict[tuple, tuple[list[Sample], RolloutCounters]] = {}  # by batch key
        self._sampler: PromptSampler | None = None  # draws the batches to come; None until a `take` positions it
        self._anchor_phase: RolloutPhase | None = None  # `phase` over `group`, as its plan was at that `take`
        self._issued = 0  # batches the thread may sample (those taken + depth)
        self._produced = 0
        self._taken = 0
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def source(self, position: dict[str, Any]) -> Callable[[RolloutCounters], list[Sample]]:
        """`RolloutPhase.generation_batch`'s `anchors_from` for the batch drawn at sampler `position`."""
        return functools.partial(self.take, position)

    def take(self, position: dict[str, Any], counters: RolloutCounters) -> list[Sample]:
        """The anchors of the generation batch drawn at sampler `position`, once sampled; the wait counts in
        `counters.anchor_seconds` (and the thread's cache hits in `anchor_cache_hits`)."""
        start, key = time.perf_counter(), self.batch_key(position)
        with self._cond:
            if self._sampler is None:  # the first batch since the start, a reset or a resume
                self._sampler, self._anchor_phase = self.phase.sampler.at(position), self.phase.on_group(self.group)
            self._issued = max(self._issued, self._taken + self.depth)
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._sample_ahead, name="anchor-prefetch", daemon=True)
                self._thread.start()
            self._cond.wait_for(lambda: key in self._ready or self._error is not None)
            self._raise_failure()
            anchors, own = self._ready.pop(key)
            self._taken += 1
            self._issued = self._taken + self.depth
            self._cond.notify_all()
        counters.anchor_cache_hits += own.anchor_cache_hits
        counters.anchor_seconds += time.perf_counter() - start
        return anchors

    def _sample_ahead(self) -> None:
        """The thread: sample the next batch's anchors whenever fewer than `_issued` were sampled."""
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._produced < self._issued)
                    sampler, phase = self._sampler, self._anchor_phase
                    key = self.batch_key(sampler.state_dict())
                    prompts = phase.draw_prompts(sampler)
                own = RolloutCounters()
                anchors = phase.sample_anchors(prompts, phase.seed(key, "ref"), own)
                with self._cond:
                    self._ready[key] = (anchors, own)
                    self._produced += 1
                    self._cond.notify_all()
        except BaseException as error:  # re-raised by the generator's `take` (or `drain`)
            with self._cond:
                self._error = error
                self._cond.notify_all()

    def drain(self) -> None:
        """Wait until the thread sampled every batch issued (it then waits for the next `take`)."""
        with self._cond:
            self._cond.wait_for(lambda: self._produced >= self._issued or self._error is not None)
            self._raise_failure()

    def reset(self) -> None:
        """Drop the anchors sampled ahead (after `drain`); the next `take` starts again from its position."""
        self.drain()
        with self._cond:
            self._ready.clear()
            self._sampler = self._anchor_phase = None
            self._issued = self._produced = self._taken = 0

    def _raise_failure(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"sampling anchors ahead failed: {error}") from error
