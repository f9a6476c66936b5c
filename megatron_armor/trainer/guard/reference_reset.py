"""The monitor-timed reference reset (`monitor.reference_reset`): ARMOR's periodic reset (armor.md §4) done when
validation says the policy is healthy, instead of every N steps.

At a validation whose val/accuracy beats every earlier one (the start's included) while no collapse-monitor alarm
holds, the reference becomes the current policy (`RLTrainer.reset_reference`): the anchors then come from the best
policy so far, and a collapse that starts later is pulled back toward it. Only a run whose algorithm has a reference
(it samples anchors from it or scores with it) resets; a run the anchor action switched to ARMOR has one from then
on. The best accuracy so far travels with the checkpoints (`state`, `load`).
"""

from __future__ import annotations

import logging
from typing import Any

from megatron_armor.algorithms import REFERENCE
from megatron_armor.trainer.guard.collapse_watch import CollapseWatch
from megatron_armor.trainer.step.loop import RLTrainer

log = logging.getLogger("megatron_armor")

STATE_KEY = "reference_reset"  # its entry in a checkpoint's trainer state (under "extra" in trainer_state.json)
METRIC = "val/accuracy"


class ReferenceReset:
    """Resets the reference at healthy new-best validations (`act`). A run has one with monitor.reference_reset and
    the monitor on (`watch` judges health)."""

    def __init__(self, trainer: RLTrainer, watch: CollapseWatch, *, is_main: bool) -> None:
        self.trainer, self.watch, self.is_main = trainer, watch, is_main
        self.best: float | None = None

    def observe_start(self, metrics: dict[str, float]) -> None:
        """The step-0 validation: the bar the first reset must beat (the reference is the start already)."""
        self.best = metrics.get(METRIC, self.best)

    def act(self, step: int, metrics: dict[str, float]) -> bool:
        """After `step` RL steps with `metrics` (its validation's, when one ran; collective: every rank sees the same
        reduced metrics): reset the reference when val/accuracy is a new best and no alarm holds; whether it did
        (armor/ref_reset joins `metrics` then)."""
        value = metrics.get(METRIC)
        if value is None or (self.best is not None and value <= self.best):
            return False
        self.best = value
        if not self.watch.quiet or not self.trainer.plan.algorithm.sources.uses(REFERENCE):
            return False
        metrics.update(self.trainer.reset_reference())
        if self.is_main:
            log.info("step %d: reference reset: %s %.4g is the best so far and no alarm holds; the reference is the "
                     "current policy now", step, METRIC, value)
        return True

    def state(self) -> dict[str, Any]:
        return {STATE_KEY: {"best": self.best}}

    def load(self, state: dict[str, Any]) -> None:
        saved = state.get(STATE_KEY)
        if saved is not None:
            self.best = saved["best"]
