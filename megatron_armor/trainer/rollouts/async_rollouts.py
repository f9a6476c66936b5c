"""rollout.mode async: a background generator keeps a buffer of generation batches filled while the trainer trains.

The generator (a daemon thread; its collectives over the overlapped modes' gloo group) produces one generation batch
at a time (`RolloutPhase.generation_batch`: prompts drawn, sampled, scored, grouped), tagged with the weight version
the engine held while it generated it, into a buffer of at most `rollout.async_buffer_batches` batches (the one in
flight included). `take(step)` pops batches in the order they were drawn until `train_batch_size` groups are in
(sync's filtering and `max_num_gen_batches`; the groups the last batch has beyond them are dropped, as sync drops
them), waiting for the generator when the buffer is empty; a batch more than `rollout.max_staleness` versions older
than the trainer's weights is dropped instead (async/dropped_stale_groups counts its kept groups; its prompts count
as drawn, as those that filtering drops). So no step trains on a sample older than `max_staleness` versions.

Without partial rollouts the actor engine's weights change only between generation batches: `settle` (before every
weight push) stops the generator after the batch in flight, not the whole buffer, and waits only until the actor's
engine is done with it (ARMOR's anchors, sampled ahead by the reference's engine, which no push changes, may still be
coming: `RolloutPhase.sample_ahead`, trainer/rollouts/anchor_prefetch.py); `take` lets it go on with the new weights.
Every rank's generator must make the same collective calls, so the point where it stops is agreed: `settle` takes the
largest number of batches any rank's generator has begun (one collective on the trainer's thread) and every generator
runs up to that many. Which batches the generator may begin (`_issued`) grows with what `take` consumed, the same on
every rank, and whether a batch began before or after a push is agreed, so its version is the same on every rank too.
Stopped, the generator begins no batch through the push, the MIPU gate, validation and checkpoints until the next
`take` (it may still be waiting for the anchors of the batch in flight).

With rollout.partial_rollouts the actor's engine is a `PausableEngine` (rollout/pausable.py): `settle` agrees on the
batches begun as above but does not wait for them to finish; it pauses the engine, which interrupts the generations
in flight (they keep their tokens so far) and returns once the engine runs none. `take` resumes it with the new
weight version, and the interrupted generations continue from their partial responses: every token carries the
version that drew it (`Sample.token_versions`). A group's version is the oldest of its tokens' (the same on every
rank: the samples are all-gathered; a group without tokens counts as current), and a batch is as old as its oldest
group for `max_staleness`. While paused, the generator may still draw prompts, sample anchors, score and gather (only
the actor's engine waits), so what checkpoints read of it is read under locks (`sampler_state`, the anchor cache).
`close` lets the batches begun finish, so no generator is left inside a collective when the run ends.

Checkpoints save the sampler's position from before the oldest batch not yet trained (buffered or generating):
buffered samples are not saved but regenerated on resume, with the checkpoint's weights, from the same prompts and
seeds (a batch's seeds derive from the sampler position it starts at). Reference resets and the anchor action drop the
buffer the same way (`discard_queued`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from megatron_armor.data.datasets import PromptSampler
from megatron_armor.data.types import Sample
from megatron_armor.distributed.reduce import max_over_ranks
from megatron_armor.rollout.pausable import PausableEngine
from megatron_armor.trainer.rollouts.rollout_phase import GenerationBatch, Rollout, RolloutPhase
from megatron_armor.trainer.rollouts.samples import mean
from megatron_armor.trainer.rollouts.rollout_schedule import OverlappedRollouts, register_schedule, staleness_metrics


@dataclasses.dataclass(frozen=True)
class BufferedBatch:
    """A generated batch waiting in the buffer and the weight version the engine held when it began (without partial
    rollouts, the version of every token in it, the same on every rank)."""

    batch: GenerationBatch
    version: int


def batch_key(position: dict[str, Any]) -> tuple:
    """The key of the generation batch drawn at sampler `position` (its seeds derive from it, so a batch generated
    again after a resume samples what it sampled)."""
    return ("async", *position.values())


def oldest_token_versions(groups: list[list[Sample]], default: int) -> list[int]:
    """Per group, the oldest of its samples' `token_versions` (`default` for a group with no token that has one)."""
    return [min((v for s in group for v in (s.token_versions or ())), default=default) for group in groups]


@register_schedule
class AsyncRollouts(OverlappedRollouts):
    """rollout.mode async: generation batches from a background generator, at most `max_staleness` versions old."""

    mode = "async"

    def __init__(self, phase: RolloutPhase, sampler: PromptSampler, last_step: int | None) -> None:
        super().__init__(phase, sampler, last_step)
        rollout = phase.plan.rollout
        self.max_staleness, self.buffer_batches = rollout.max_staleness, rollout.async_buffer_batches
        self._thread: threading.Thread | None = None
        # counts of batches since the start (the same on every rank but `_begun` / `_finished` between agreements)
        self._issued = 0  # batches the generator may begin (consumed + buffer size)
        self._limit: float = 0  # ... and at most this many (the agreed stop of `settle`; inf while running)
        self._begun = 0
        self._finished = 0
        self._sampled = 0  # batches whose on-policy samples are drawn (the actor's engine is done with them)
        self._consumed = 0  # batches `take` popped (trained on or dropped)
        self._buffer: collections.deque[BufferedBatch] = collections.deque()  # finished, not yet consumed
        # the sampler's position before each batch begun and not yet consumed (its prompts are drawn from there)
        self._positions: collections.deque[dict[str, Any]] = collections.deque()
        self._stopped = True  # `settle` stopped the generator and nothing resumed it since
        # rollout.partial_rollouts: the actor's engine, paused by `settle` (phase.models is built with it)
        self.pausable: PausableEngine | None = phase.models.actor.engine if rollout.partial_rollouts else None
        self._idle_since = 0.0  # when the generator last began waiting (perf_counter)
        self._generating = 0.0  # s the generator spent on batches during this step

    def take(self, step: int) -> Rollout:
        last = self.last_step is not None and step + 1 >= self.last_step
        self._resume()
        collector, taken, dropped = self.phase.new_collector(), [], 0
        while not collector.done:
            self._issue(self._consumed + 1 if last else self._consumed + self.buffer_batches)
            item = self._pop()
            versions = self._group_versions(item)
            if self.version - min(versions, default=self.version) > self.max_staleness:
                dropped += len(item.batch.groups)
                continue
            collector.add(item.batch.groups, item.batch.stats)
            taken.append((item, versions))
        if not last:
            self._issue(self._consumed + self.buffer_batches)
        rollout = self.phase.assemble(collector, [item.batch for item, _ in taken], None)
        versions = [version for _, group_versions in taken for version in group_versions][: len(rollout.groups)]
        rollout = dataclasses.replace(rollout, versions=versions)
        metrics = {**rollout.metrics, **staleness_metrics(self.version, rollout),
                   "async/dropped_stale_groups": float(dropped)}
        if self.pausable is not None:
            metrics["async/partial_fraction"] = partial_fraction(rollout.groups)
        return dataclasses.replace(rollout, metrics=metrics)

    def _group_versions(self, item: BufferedBatch) -> list[int]:
        """The weight version of each of `item`'s groups: its batch's (without partial rollouts), else its oldest
        token's (a group without tokens: the trainer's current version)."""
        if self.pausable is None:
            return [item.version] * len(item.batch.groups)
        return oldest_token_versions(item.batch.groups, self.version)

    def _resume(self) -> None:
        """Let the generator begin batches again (with the engine's current weights) and interrupted generations go
        on; start it the first time."""
        with self._cond:
            self._limit, self._stopped = math.inf, False
            self._cond.notify_all()
        if self.pausable is not None:
            self.pausable.resume(self.version)
        if self._thread is None:
            self._idle_since = time.perf_counter()
            self._thread = self._start_thread("rollout-generator", self._generate_forever)

    def _issue(self, count: int) -> None:
        """Let the generator begin up to `count` batches in all (the same `count` on every rank)."""
        with self._cond:
            self._issued = max(self._issued, count)
            self._cond.notify_all()

    def _pop(self) -> BufferedBatch:
        """The oldest buffered batch, waiting for the generator when there is none (re-raises its failure)."""
        start = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: self._buffer or self._error is not None)
            self._raise_failure("the asynchronous rollout generator")
            self._positions.popleft()
            self._consumed += 1
            self._perf.trainer_idle += time.perf_counter() - start
            return self._buffer.popleft()

    def _generate_forever(self) -> None:
        """The generator's loop: begin a batch whenever `_issued` and `_limit` allow, buffer it with its version."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._begun < min(self._issued, self._limit))
                self._begun += 1
                version, position = self.version, self.sampler.state_dict()
                self._positions.append(position)
                began = time.perf_counter()
                self._perf.rollout_idle += began - self._idle_since
            batch = self.phase.generation_batch(batch_key(position), self._actor_done)  # seeds: the same if regenerated
            with self._cond:
                self._buffer.append(BufferedBatch(batch, version))
                self._finished += 1
                self._idle_since = time.perf_counter()
                self._generating += self._idle_since - began
                self._cond.notify_all()

    @staticmethod
    def ahead_depth(phase: RolloutPhase) -> int:
        """The batches the generator may have begun beyond the one in use: the buffer's."""
        return phase.plan.rollout.async_buffer_batches

    def _actor_done(self) -> None:
        """The actor's engine is done with the batch in flight (its anchors may still be coming): a push need not wait
        for the rest of it."""
        with self._cond:
            self._sampled += 1
            self._cond.notify_all()

    def settle(self) -> None:
        """Stop the generator after the batches any rank's generator has begun (collective, the first call after a
        `take`) and wait until the actor's engine is done with them, or with partial rollouts pause the engine in the
        middle of them; the wait counts as the trainer's idle time."""
        if self._stopped:
            return
        start = time.perf_counter()
        with self._cond:
            self._limit = self._begun
        agreed = max_over_ranks(self._begun)  # each rank's own count is final: its `_limit` holds it
        with self._cond:
            self._limit = agreed
            self._cond.notify_all()
        if self.pausable is not None:
            self.pausable.pause()
        else:  # the actor's engine is done with them (their anchors may still be coming: no push changes the reference)
            self._wait_until(lambda: self._sampled >= self._limit)
        self._stopped = True
        self._perf.trainer_idle += time.perf_counter() - start

    def _wait_until(self, reached: Callable[[], bool]) -> None:
        """Wait until `reached()` (read under the lock) holds of the batches `settle` let the generator begin; re-raises
        the generator's failure."""
        with self._cond:
            self._cond.wait_for(lambda: reached() or self._error is not None)
            self._raise_failure("the asynchronous rollout generator")

    def close(self) -> None:
        """Let the batches begun finish (their collectives with them), and the anchors sampled ahead: the run ends with
        no thread inside one."""
        self.settle()
        if self.pausable is not None:
            self.pausable.resume(self.version)
        self._wait_until(lambda: self._finished >= self._limit)
        if self.pausable is not None:
            self.pausable.pause()
        self.phase.drain_ahead()

    def discard_queued(self) -> None:
        self.close()
        self.phase.drop_ahead()
        if self._positions:
            self.sampler.load_state_dict(self._positions[0])
        self._buffer.clear()
        self._positions.clear()
        self._consumed = self._issued = self._sampled = self._finished

    def sampler_state(self) -> dict[str, Any]:
        self.settle()
        self.phase.drain_ahead()  # no batch is begun until the next take: the anchor cache is still while it is read
        with self._cond:  # a paused generator may still begin an agreed batch: it records the position first
            return dict(self._positions[0] if self._positions else self.sampler.state_dict())

    def step_metrics(self) -> dict[str, float]:
        """The overlapped modes' perf/*; perf/overlap_fraction is the share of the step's generating time during which
        the trainer did not wait for it."""
        with self._cond:
            generating, self._generating = self._generating, 0.0
            idle = self._perf.trainer_idle
            self._perf.overlap_fraction = max(0.0, generating - idle) / generating if generating else 0.0
            return super().step_metrics()


def partial_fraction(groups: list[list[Sample]]) -> float:
    """The share of the groups' on-policy samples whose tokens more than one weight version drew (partial rollouts
    continued after a push); 0.0 without on-policy samples."""
    on_policy = [s for group in groups for s in group if not s.is_anchor]
    return mean(len(set(s.token_versions or ())) > 1 for s in on_policy)
