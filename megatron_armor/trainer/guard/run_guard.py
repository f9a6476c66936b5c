"""`RunGuard`: the collapse guard of one run as the run loop sees it: the monitor's watch, the best checkpoint it
restores, the anchor actions, the monitor-timed reference reset and a LoRA run's reference reset, fed the start's
validation and every step's metrics in one place."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_armor.trainer.checkpointing.best_checkpoint import BestCheckpoint
from megatron_armor.trainer.guard.adapter_reset import AdapterReset
from megatron_armor.trainer.guard.anchor_switch import AnchorSwitch
from megatron_armor.trainer.guard.collapse_watch import CollapseWatch, WatchVerdict
from megatron_armor.trainer.guard.reference_reset import ReferenceReset


@dataclass
class RunGuard:
    """The watch (always there; it adds nothing when the monitor is off) and the optional best checkpoint
    (checkpoint.keep_best), anchor actions (an alarm's action anchor / anchor_keep), reference reset
    (monitor.reference_reset) and a LoRA run's reference reset (algorithm.ref_reset_period under model.lora)."""

    watch: CollapseWatch
    best: BestCheckpoint | None = None
    anchor: AnchorSwitch | None = None
    reset: ReferenceReset | None = None
    adapter_reset: AdapterReset | None = None

    @property
    def trackers(self) -> list[Any]:
        """The parts whose state rides in every checkpoint (`state` / `load`)."""
        return [part for part in (self.watch, self.best, self.anchor, self.reset) if part is not None]

    def observe_start(self, metrics: dict[str, float], start: Path, checkpoints: Path, *, is_main: bool) -> None:
        """The step-0 validation's `metrics`: the monitor's first validation, the start (`start`, model.path) as the
        first restore point (named in `checkpoints`/BEST while it is the best), the reference reset's first bar."""
        self.watch.observe(0, metrics)  # nothing to act on yet
        if self.best is not None:
            self.best.consider_start(metrics, start, checkpoints, is_main=is_main)
        if self.reset is not None:
            self.reset.observe_start(metrics)

    def observe(self, step: int, metrics: dict[str, float]) -> tuple[WatchVerdict, bool]:
        """After `step` RL steps with `metrics` (collective): the monitor's verdict, then the anchor action it asks
        for, else a reference reset at a healthy new best, else a LoRA run's due adapter reset; (the verdict, whether
        an anchor action or adapter reset took place: the weights then are not those `metrics` describe)."""
        verdict = self.watch.observe(step, metrics)
        anchored = self.anchor is not None and self.anchor.act(step, verdict.anchoring, metrics,
                                                               restart=verdict.restarting)
        if self.reset is not None and not anchored:
            self.reset.act(step, metrics)
        if self.adapter_reset is not None and not anchored:
            anchored = self.adapter_reset.act(step, metrics)
        return verdict, anchored
