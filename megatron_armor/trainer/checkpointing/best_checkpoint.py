"""The best checkpoint of a run by a validation metric (`checkpoint.keep_best`): which saved step it is, kept out of
`checkpoint.keep_last`'s pruning and named in `checkpoints/BEST` and metrics.jsonl (`checkpoint/best_step`).

A checkpoint is a candidate when the step it is saved at also validated (config validation makes
checkpoint.every a multiple of eval.every), so its value is that of the weights it holds. So is the start (step 0,
with the validation before the first step, eval.before_train): the model the run started from, named by its own
path (model.path) rather than copied. The choice travels with the checkpoints (`state` / `load`), so a resumed run
keeps its best.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_armor.config import CheckpointConfig

STATE_KEY = "best_checkpoint"  # its entry in a checkpoint's trainer state (under "extra" in trainer_state.json)
BEST_FILE = "BEST"  # checkpoints/BEST: {"step", "path", "metric", "value"} of the best complete checkpoint
START_STEP = 0  # the best "checkpoint" is the run's start: model.path


@dataclass
class BestCheckpoint:
    """The best saved step by the validation metric checkpoint.keep_best names (higher is better unless
    checkpoint.best_mode is min); `step` and `value` are None until one is saved. A run without keep_best has none."""

    settings: CheckpointConfig
    step: int | None = None
    value: float | None = None

    def __post_init__(self) -> None:
        if self.settings.keep_best is None:
            raise ValueError("a best checkpoint needs checkpoint.keep_best (the validation metric it compares)")

    @property
    def metric(self) -> str:
        return self.settings.keep_best

    @property
    def lower_is_better(self) -> bool:
        return self.settings.best_mode == "min"

    def improved_by(self, metrics: dict[str, float]) -> bool:
        """Whether a checkpoint of the weights `metrics` (a step's, with its validation) describe beats the best."""
        value = metrics.get(self.metric)
        if value is None or not math.isfinite(value):
            return False
        if self.value is None:
            return True
        return value < self.value if self.lower_is_better else value > self.value

    def choose(self, step: int, metrics: dict[str, float]) -> None:
        """The checkpoint of step `step` is the best now; `metrics` gain checkpoint/best_step and best_value."""
        self.step, self.value = step, float(metrics[self.metric])
        metrics.update({"checkpoint/best_step": float(step), "checkpoint/best_value": self.value})

    def write_note(self, root: Path, location: str) -> None:
        """checkpoints/BEST (in `root`) naming the best: `location`, a checkpoint's directory name in `root` (rank 0,
        once it is complete), or the start's own path (absolute)."""
        note = {"step": self.step, "path": location, "metric": self.metric, "value": self.value}
        root.mkdir(parents=True, exist_ok=True)
        (root / BEST_FILE).write_text(json.dumps(note, indent=2) + "\n")

    def consider_start(self, metrics: dict[str, float], start: Path, root: Path, *, is_main: bool) -> None:
        """The run's start (`start`: model.path) is the first candidate, by its step-0 validation `metrics`
        (`choose` adds checkpoint/best_*); checkpoints/BEST in `root` names it while it is the best (main rank)."""
        if self.improved_by(metrics):
            self.choose(START_STEP, metrics)
            if is_main:
                self.write_note(root, str(start.resolve()))

    def state(self) -> dict[str, Any]:
        return {STATE_KEY: {"metric": self.metric, "step": self.step, "value": self.value}}

    def load(self, state: dict[str, Any]) -> None:
        """Restore the choice from a checkpoint's trainer state (saved by a run tracking the same metric)."""
        saved = state.get(STATE_KEY)
        if saved is not None and saved["metric"] == self.metric:
            self.step, self.value = saved["step"], saved["value"]
