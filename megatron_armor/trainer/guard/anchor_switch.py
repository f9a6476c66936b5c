"""The collapse monitor's anchor actions (`monitor.actions: [<kind>=anchor]` or `anchor_keep`): ARMOR's protocol
(armor.md §0, §4) timed by the monitor instead of by hand.

When an alarm whose action is anchor fires after RL step s, the run goes back to its best checkpoint so far
(`checkpoint.keep_best`, trainer/checkpointing/best_checkpoint.py): its actor's weights become both the policy and the
frozen reference, the optimizer starts afresh and the lr warmup counts again from step s, as the paper's restart does,
and from step s on the run trains ARMOR (`ANCHORED_ALGORITHM`, built through the registry from `Algorithm.anchored_config`:
armor.alpha, rollout.anchors, groups of the run's on-policy samples + 1). A grpo / grpo_kl run switches the first
time; every later alarm (or any alarm of a run that was ARMOR from the start) resets policy and reference to the
best checkpoint again: the paper's reference reset.

The gentle action, anchor_keep, throws no progress away: the actor's weights, its optimizer and the lr schedule go
on, only the reference becomes the best checkpoint's weights, and the run trains ARMOR from then on (its anchors and
mixed ratio pull the policy back toward the best checkpoint's behaviour). When a step's alarms ask for both, anchor
wins.

Under LoRA (model.lora) the reference is the base and never moves: anchor restores the best checkpoint's adapters and
their optimizer state into the actor (the base is untouched) and trains ARMOR against the base from then on
(`restore_point`, which a LoRA run's reference reset shares: trainer/guard/adapter_reset.py); anchor_keep is refused
(config validation: the model holds one set of adapters, the actor's, so the best checkpoint's cannot become the
reference beside them).

The best checkpoint may be the start (step 0: the model the run started from, with its step-0 validation); its
weights are then read from model.path again (`StartWeights`; under LoRA the adapters as they were built), not from a
copy. `AnchorState` is the one record of the actions, carried in every checkpoint, so a resumed run trains ARMOR
again with the reference its checkpoint holds.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_armor.algorithms import ANCHORED_ALGORITHM, build_anchored_algorithm
from megatron_armor.config import ArmorConfig
from megatron_armor.monitor import Alarm
from megatron_armor.trainer.checkpointing.best_checkpoint import START_STEP, BestCheckpoint
from megatron_armor.trainer.checkpointing.checkpoint import load_modules, step_dirs
from megatron_armor.trainer.checkpointing.checkpoint_save import CheckpointSaver
from megatron_armor.trainer.checkpointing.sharded_state import OPTIMIZER
from megatron_armor.trainer.guard.collapse_watch import CollapseWatch
from megatron_armor.trainer.step.loop import RLTrainer

log = logging.getLogger("megatron_armor")

STATE_KEY = "anchor"  # its entry in a checkpoint's trainer state (under "extra" in trainer_state.json)

# The weights the run's actor started from, as a loaded "actor" entry of `RLTrainer.sharded_state_dict` (collective)
StartWeights = Callable[[], dict[str, Any]]


@dataclass
class AnchorState:
    """Where the run stands with the anchor action (JSON-able, the same on every rank)."""

    mode: str  # the algorithm training now: the run's algorithm.name, ANCHORED_ALGORITHM after a switch
    anchors: int = 0  # actions taken so far (switches, restarts and kept-weight reference changes)
    step: int | None = None  # RL steps done at the last restart (anchor): the lr warmup counts from this step
    reference_step: int | None = None  # the best checkpoint's step the reference came from at the last action


def best_checkpoint_dir(best: BestCheckpoint, saver: CheckpointSaver) -> Path:
    """The directory of the best checkpoint (`best.step` is a saved step), its save finished first (it may be the
    one still in flight)."""
    saver.finalize()
    return step_dirs(saver.root, best.step)[0]


def restore_point(trainer: RLTrainer, best: BestCheckpoint, saver: CheckpointSaver,
                  start_weights: StartWeights) -> tuple[dict[str, Any], str]:
    """The best checkpoint's modules a restart restores into the actor (collective; `best.step` is set), and where
    they came from, for the log: {"actor": its weights}; under LoRA (`Policy.adapters_only`) the adapters and their
    optimizer state ("optimizer"), which go on from where the best checkpoint was. The start (step 0) has weights
    only (`start_weights`), the optimizer starts afresh."""
    actor = trainer.models.actor
    if best.step == START_STEP:
        return {actor.name: start_weights()}, "the run's start (model.path), the best so far"
    checkpoint = best_checkpoint_dir(best, saver)
    if actor.adapters_only:
        request = trainer.sharded_state_dict(is_loading=True, names=[actor.name, OPTIMIZER])["modules"]
    else:
        request = {actor.name: actor.sharded_state_dict(prefix=actor.checkpoint_prefix)}
    return load_modules(checkpoint, request), f"the best checkpoint {checkpoint.name}"


class AnchorSwitch:
    """Acts on the anchor alarms of a run (`act`); its `AnchorState` travels with the checkpoints (`state`, `load`).
    `start_weights` reads the run's starting weights when the best checkpoint is the start. A run has one when an
    alarm's action is anchor or anchor_keep (`MonitorConfig.anchors`; config validation gave it checkpoint.keep_best,
    so `best` is there)."""

    def __init__(self, cfg: ArmorConfig, trainer: RLTrainer, best: BestCheckpoint, saver: CheckpointSaver,
                 watch: CollapseWatch, start_weights: StartWeights, *, is_main: bool) -> None:
        self.cfg, self.trainer, self.best, self.saver, self.is_main = cfg, trainer, best, saver, is_main
        self.watch, self.start_weights = watch, start_weights
        self.record = AnchorState(mode=cfg.algorithm.name)

    def act(self, step: int, alarms: tuple[Alarm, ...], metrics: dict[str, float], *, restart: bool) -> bool:
        """After `step` RL steps whose anchor alarms (agreed by every rank) are `alarms` (collective): when there are
        some and a best checkpoint is known, continue as ARMOR from it, restarted (`restart`: an alarm's action is
        anchor) or keeping the current weights (anchor_keep; see the module docstring). Adds monitor/anchored (1
        when it acted) to `metrics`; whether it did."""
        metrics["monitor/anchored"] = 0.0
        if not alarms:
            return False
        if self.best.step is None:
            if self.is_main:
                log.warning("step %d: anchor: no best checkpoint yet (checkpoint.keep_best %s); training goes on as %s",
                            step, self.best.metric, self.record.mode)
            return False
        best_state, source = self._best_state(restart=restart)
        self.trainer.use_algorithm(build_anchored_algorithm(self.cfg))
        if restart:
            metrics.update(self.trainer.restart_from(best_state, step))
        else:
            metrics.update(self.trainer.set_reference(best_state[self.trainer.models.actor.name]))
        self.watch.rearm()  # a collapse that goes on fires (and acts) again, on evidence gathered from here
        switched = self.record.mode != ANCHORED_ALGORITHM
        self.record = AnchorState(ANCHORED_ALGORITHM, self.record.anchors + 1, step if restart else self.record.step,
                                  self.best.step)
        metrics["monitor/anchored"] = 1.0
        if self.is_main:
            mode = f"switched to {ANCHORED_ALGORITHM}" if switched else f"{ANCHORED_ALGORITHM}'s reference reset"
            best = f"{source} (step {self.best.step}, {self.best.metric} {self.best.value:.4g})"
            if restart and self.trainer.models.actor.adapters_only:
                log.warning("step %d: anchor on alarm %s: %s; the LoRA adapters and their optimizer state from %s, "
                            "the reference stays the base, lr warmup (anchor %d)", step,
                            ", ".join(a.kind for a in alarms), mode, best, self.record.anchors)
            elif restart:
                log.warning("step %d: anchor on alarm %s: %s; actor and reference from %s, a fresh optimizer and lr "
                            "warmup (anchor %d)", step, ", ".join(a.kind for a in alarms), mode, best,
                            self.record.anchors)
            else:
                log.warning("step %d: anchor_keep on alarm %s: %s; the reference from %s, the actor's weights, "
                            "optimizer and lr schedule kept (anchor %d)", step, ", ".join(a.kind for a in alarms), mode,
                            best, self.record.anchors)
        return True

    def _best_state(self, *, restart: bool) -> tuple[dict[str, Any], str]:
        """The best checkpoint's modules the action restores (collective), and where they came from, for the log:
        {"actor": its weights} read into the actor's own tensors for a restart (`restore_point`), into the
        reference's for anchor_keep (a checkpoint's load fills the tensors it is given, so the actor's stay
        untouched)."""
        if restart or self.best.step == START_STEP:
            return restore_point(self.trainer, self.best, self.saver, self.start_weights)
        checkpoint = best_checkpoint_dir(self.best, self.saver)
        actor = self.trainer.models.actor
        request = {actor.name: self.trainer.models.ref.sharded_state_dict(prefix=actor.checkpoint_prefix)}
        return load_modules(checkpoint, request), f"the best checkpoint {checkpoint.name}"

    def state(self) -> dict[str, Any]:
        return {STATE_KEY: dataclasses.asdict(self.record)}

    def load(self, state: dict[str, Any]) -> None:
        """Restore the record from a checkpoint's trainer state and, after an action, ARMOR mode and the warmup's
        start (the reference's weights come back with the trainer's modules)."""
        saved = state.get(STATE_KEY)
        if saved is None:
            return
        self.record = AnchorState(**saved)
        if self.record.anchors:
            self.trainer.use_algorithm(build_anchored_algorithm(self.cfg))
        if self.record.step is not None:
            self.trainer.warmup_from = self.record.step
