"""A LoRA run's reference reset (`algorithm.ref_reset_period` under model.lora): the reference is the base with the
adapters off and never moves, so where a full run copies the actor into the reference every N steps, a LoRA run
resets the adapters and their optimizer state to the best checkpoint's (checkpoint.keep_best; config validation
requires it) with the anchor action's restore (`anchor_switch.restore_point`, `RLTrainer.restart_from`); the
algorithm and the lr schedule go on. A step whose validation is a new best keeps its adapters: they are the best so
far. The best checkpoint may be the start: the adapters then start again as they were built (B = 0), with a fresh
optimizer.
"""

from __future__ import annotations

import logging

from megatron_armor.trainer.checkpointing.best_checkpoint import BestCheckpoint
from megatron_armor.trainer.checkpointing.checkpoint_save import CheckpointSaver
from megatron_armor.trainer.guard.anchor_switch import StartWeights, restore_point
from megatron_armor.trainer.step.loop import RLTrainer

log = logging.getLogger("megatron_armor")


class AdapterReset:
    """Resets a LoRA actor's adapters to the best checkpoint's every `algorithm.ref_reset_period` RL steps (`act`)."""

    def __init__(self, trainer: RLTrainer, best: BestCheckpoint, saver: CheckpointSaver, start_weights: StartWeights,
                 *, is_main: bool) -> None:
        self.trainer, self.best, self.saver = trainer, best, saver
        self.start_weights, self.is_main = start_weights, is_main

    def act(self, step: int, metrics: dict[str, float]) -> bool:
        """After `step` RL steps with `metrics` (collective: every rank sees the same reduced metrics): at a reset
        step, the adapters and their optimizer state become the best checkpoint's, unless there is none yet or
        `metrics` (this step's validation) set a new best; whether they did (armor/ref_reset joins `metrics` then)."""
        if not self.trainer.plan.resets_reference_after(step - 1):
            return False
        if self.best.step is None or self.best.improved_by(metrics):
            if self.is_main:
                log.info("step %d: reference reset: the adapters stay (%s)", step, "no best checkpoint yet"
                         if self.best.step is None else f"{self.best.metric} {metrics[self.best.metric]:.4g} is the "
                         "best so far")
            return False
        state, source = restore_point(self.trainer, self.best, self.saver, self.start_weights)
        metrics.update(self.trainer.restart_from(state, step, warmup=False))
        metrics["armor/ref_reset"] = 1.0
        if self.is_main:
            log.warning("step %d: reference reset under LoRA: the adapters and their optimizer state from %s (step %d, "
                        "%s %.4g); the reference stays the base", step, source, self.best.step, self.best.metric,
                        self.best.value)
        return True
