"""When a step's rollouts run (`rollout.mode`): each step's own, or the next step's while this one trains.

A rollout carries the weight version that sampled it (`RolloutSchedule.version`: how many updates the trainer
kept and pushed so far); its staleness is how many versions the trainer's weights are ahead of it when it trains.
An update that is not kept does not advance the version: one MIPU's gate rolled back (the trainer and the engine
hold the weights from before it again) or one skipped for a non-finite loss or gradient.

`sync`: step t generates its samples, then trains on them; they come from the weights the step starts with
(staleness 0).

`one_step_off`: step t takes the rollout prepared during step t-1 and starts step t+1's in a background thread, from
the weights before step t's update (theta_t), while step t trains; the trainer waits for it to finish before it pushes
its new weights (the engine never changes weights mid-rollout), so validation, checkpoints and the MIPU gate find no
rollout in flight. ARMOR's anchors are sampled ahead, on a thread of their own (`RolloutPhase.sample_ahead`;
trainer/rollouts/anchor_prefetch.py): the next rollout's while this one is generated. Samples are one weight version
old: the loss corrects them with the behaviour importance weight (algorithm.behaviour_correction; MIPU's own Step 1
weight against the engine's logprobs). When the gate rejects step t's update, the queued rollout is kept: the rollback
restores theta_t, the weights that sampled it, so step t+1 trains on it exactly on-policy (staleness 0); an accepted
update leaves it one version old. The background rollout's collectives run over a gloo group of their own, so they
never interleave with the trainer's on the default group.

A checkpoint saves the sampler's position from before the queued rollout, so a resumed run regenerates it
(with the checkpoint's weights): no prompt is trained twice or skipped. A reference reset drops the queued
rollout the same way (its anchors came from the old reference).

`async` (a generator filling a buffer of generation batches, at most rollout.max_staleness versions old when trained)
is trainer/rollouts/async_rollouts.py's; `OverlappedRollouts` holds what it shares with `one_step_off`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

import torch.distributed as dist

from megatron_armor.data.datasets import PromptSampler
from megatron_armor.trainer.rollouts.rollout_phase import Rollout, RolloutPhase
from megatron_armor.trainer.rollouts.samples import mean

ROLLOUT_SCHEDULES: dict[str, type[RolloutSchedule]] = {}


def register_schedule(cls: type[RolloutSchedule]) -> type[RolloutSchedule]:
    """Class decorator: make `cls` the schedule of rollout.mode `cls.mode`."""
    ROLLOUT_SCHEDULES[cls.mode] = cls
    return cls


class RolloutSchedule:
    """Hands each RL step its rollout (`take`) and keeps the engine's weights still while one is generating
    (`settle` before a weight push). Collective: every rank makes the same calls."""

    mode: ClassVar[str]

    def __init__(self, phase: RolloutPhase, sampler: PromptSampler, last_step: int | None) -> None:
        self.phase, self.sampler, self.last_step = phase, sampler, last_step
        self.version = 0  # the weight version the actor's engine holds (counts `weights_changed` calls)

    @classmethod
    def build(cls, mode: str, make_phase, sampler: PromptSampler, last_step: int | None) -> RolloutSchedule:
        """The schedule of rollout.mode `mode`; `make_phase(group)` builds its rollout phase over a process group
        (None: the default one); no rollout is generated ahead for a step >= `last_step` (None: no limit)."""
        schedule = ROLLOUT_SCHEDULES[mode]
        return schedule(make_phase(schedule.rollout_group()), sampler, last_step)

    @classmethod
    def rollout_group(cls) -> dist.ProcessGroup | None:
        """The process group the rollout phase's collectives use (None: the default group)."""
        return None

    def take(self, step: int) -> Rollout:
        """The rollout RL step `step` trains on, with its perf/* and async/* metrics."""
        raise NotImplementedError

    def weights_changed(self) -> None:
        """The trainer pushed weights of a kept update: the engine holds the next weight version."""
        self.version += 1

    def settle(self) -> None:
        """Make the actor's engine still (before its weights change): wait until no rollout is generating, or with
        partial rollouts pause the engine mid-rollout (trainer/rollouts/async_rollouts.py); the wait counts as the
        trainer's idle time (`step_metrics`)."""

    def close(self) -> None:
        """Let what generates finish (at the end of a run: no background rollout is left inside a collective)."""
        self.settle()

    def discard_queued(self) -> None:
        """Drop a rollout generated ahead (its samples are no longer valid, e.g. after a reference reset); its
        prompts are drawn again."""

    def sampler_state(self) -> dict[str, Any]:
        """The prompt sampler's position as a checkpoint saves it: before any rollout generated ahead (and with no
        anchors being sampled, so that what the checkpoint reads of the anchor cache stands still)."""
        return self.sampler.state_dict()

    def step_metrics(self) -> dict[str, float]:
        """The overlap figures of the step since the last call (perf/trainer_idle_seconds, perf/rollout_idle_seconds,
        perf/overlap_fraction); none when nothing overlaps."""
        return {}


@register_schedule
class SyncRollouts(RolloutSchedule):
    """rollout.mode sync: each step generates its own rollout from the weights it starts with (staleness 0: no async/*
    metrics)."""

    mode = "sync"

    def take(self, step: int) -> Rollout:
        return self.phase.collect(step).sampled_by(self.version)


class OverlappedRollouts(RolloutSchedule):
    """What the modes that generate beside training (one_step_off, async) share: their rollout phase's collectives run
    over a gloo group of their own, its work runs on a daemon thread whose failure is raised on the trainer's thread
    (`_raise_failure`), the phase's extra sources (ARMOR's anchors) sample ahead over a gloo group of their own
    (`RolloutPhase.sample_ahead`), and the step's overlap figures (`_perf`, `step_metrics`)."""

    def __init__(self, phase: RolloutPhase, sampler: PromptSampler, last_step: int | None) -> None:
        super().__init__(phase, sampler, last_step)
        self._cond = threading.Condition()  # guards the background thread's state; notified when it fails
        self._error: BaseException | None = None
        self._perf = _StepPerf()
        # what the extra sources sample ahead (ARMOR's anchors) runs over a gloo group of its own (collective to make)
        phase.sample_ahead(self.rollout_group(), self.ahead_depth(phase))

    @staticmethod
    def ahead_depth(phase: RolloutPhase) -> int:
        """How many generation batches beyond the one in use the phase's extra sources sample ahead (one_step_off:
        the next rollout's first)."""
        return 1

    def close(self) -> None:
        """Let the rollout generating finish, and what the extra sources sample ahead."""
        super().close()
        self.phase.drain_ahead()

    @classmethod
    def rollout_group(cls) -> dist.ProcessGroup | None:
        """A gloo group over every rank (collective to create), or None without torch.distributed."""
        return dist.new_group(backend="gloo") if dist.is_initialized() else None

    def _start_thread(self, name: str, work: Callable[[], None]) -> threading.Thread:
        """Run `work` on a daemon thread named `name`; what it raises is kept (and `_cond` notified) for
        `_raise_failure`."""

        def run() -> None:
            try:
                work()
            except BaseException as error:  # re-raised on the trainer's thread by `_raise_failure`
                with self._cond:
                    self._error = error
                    self._cond.notify_all()

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        return thread

    def _raise_failure(self, what: str) -> None:
        """Raise what the background thread raised, if anything, as `what` failing."""
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"{what} failed: {error}") from error

    def step_metrics(self) -> dict[str, float]:
        perf, self._perf = self._perf, _StepPerf()
        return {"perf/trainer_idle_seconds": perf.trainer_idle, "perf/rollout_idle_seconds": perf.rollout_idle,
                "perf/overlap_fraction": perf.overlap_fraction}


@register_schedule
class OneStepOffRollouts(OverlappedRollouts):
    """rollout.mode one_step_off: step t+1's rollout generates in a background thread while step t trains."""

    mode = "one_step_off"

    def __init__(self, phase: RolloutPhase, sampler: PromptSampler, last_step: int | None) -> None:
        super().__init__(phase, sampler, last_step)
        self._thread: threading.Thread | None = None
        self._queued: Rollout | None = None  # step `_queued_step`'s rollout, generated ahead
        self._queued_step = -1
        self._sampler_before_queue: dict[str, Any] | None = None  # the sampler's position before the queued rollout
        self._generated_at = 0.0  # when the engine finished its last rollout (perf_counter)
        self._generating_seconds = 0.0  # how long the background rollout took

    def take(self, step: int) -> Rollout:
        self.settle()
        if self._queued is not None and self._queued_step == step:
            rollout = self._queued
            self._queued, self._sampler_before_queue = None, None
        else:  # the first step, or after a resume or a dropped rollout: generate it now, in the foreground
            self.discard_queued()
            began = time.perf_counter()
            rollout = self.phase.collect(step).sampled_by(self.version)
            self._generated_at = time.perf_counter()
            self._perf.trainer_idle += self._generated_at - began
        if self.last_step is None or step + 1 < self.last_step:
            self._start(step + 1, version=self.version)
        return dataclasses.replace(rollout, metrics={**rollout.metrics, **staleness_metrics(self.version, rollout)})

    def _start(self, step: int, *, version: int) -> None:
        """Generate step `step`'s rollout in the background from the engine's current weights (`version`)."""
        self._sampler_before_queue = self.sampler.state_dict()
        self._queued_step = step
        began = time.perf_counter()
        self._perf.rollout_idle += began - self._generated_at

        def generate() -> None:
            try:
                self._queued = self.phase.collect(step).sampled_by(version)
            finally:
                self._generated_at = time.perf_counter()
                self._generating_seconds = self._generated_at - began

        self._thread = self._start_thread(f"rollout-step-{step}", generate)

    def settle(self) -> None:
        if self._thread is None:
            return
        start = time.perf_counter()
        self._thread.join()
        self._thread = None
        waited = time.perf_counter() - start
        if self._error is not None:
            self._queued = None
            self._raise_failure(f"the rollout of step {self._queued_step}, generated ahead,")
        self._perf.trainer_idle += waited
        if self._generating_seconds > 0:
            self._perf.overlap_fraction = max(0.0, self._generating_seconds - waited) / self._generating_seconds

    def discard_queued(self) -> None:
        self.settle()
        self.phase.drop_ahead()
        if self._sampler_before_queue is not None:
            self.sampler.load_state_dict(self._sampler_before_queue)
        self._queued, self._sampler_before_queue = None, None

    def sampler_state(self) -> dict[str, Any]:
        self.settle()
        self.phase.drain_ahead()
        return dict(self._sampler_before_queue or self.sampler.state_dict())


@dataclasses.dataclass
class _StepPerf:
    """One RL step's overlap figures (the overlapped modes)."""

    trainer_idle: float = 0.0  # s the trainer waited for a rollout (generating one in the foreground included)
    rollout_idle: float = 0.0  # s the engine waited between the end of a rollout and the start of the next
    overlap_fraction: float = 0.0  # share of the rollout generated during this step that ran beside training


def staleness_metrics(version: int, rollout: Rollout) -> dict[str, float]:
    """async/staleness_mean|max: over the rollout's samples, how many weight versions each lags the trainer's weights
    (`version`); 0 without samples."""
    lags = [version - sampled for group, sampled in zip(rollout.groups, rollout.versions, strict=True) for _ in group]
    return {"async/staleness_mean": mean(lags), "async/staleness_max": float(max(lags, default=0))}
