"""The `monitor` section: the collapse monitor's alarms (megatron_armor.monitor), each a threshold and an action."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_armor.config.base import check_choices, doc, require, require_at_least

AlarmAction = Literal["warn", "stop"]
ACTION_HELP = ("warn: log the alarm's reason and go on; stop: checkpoint, then exit with an error naming the alarm "
               "(anchor, switching to ARMOR from the best checkpoint, is not built yet)")


@dataclass
class MonitorConfig:
    """Which alarms the collapse monitor raises and what each does. Alarm <kind> has a threshold `<kind>` (null:
    off) and an action `<kind>_action`; it fires (monitor/alarm_<kind> = 1) on the step its condition starts to
    hold, and again only after it stopped holding."""

    enabled: bool = doc(False, "watch every step's metrics for over-optimization and log monitor/* (off: none logged)")
    window: int = doc(
        5, "steps in the windows of the per-step alarms (means, and the baseline jumps are measured against), and "
        "validations in the reward-gap trend"
    )
    reward_gap: float | None = doc(
        0.2, "alarm reward_gap: train/accuracy (mean over the steps since the previous validation) minus val/accuracy "
        "above this while the gap widens (positive slope over the window's validations)"
    )
    reward_gap_action: AlarmAction = doc("warn", f"action of reward_gap: {ACTION_HELP}")
    val_drop: float | None = doc(0.1, "alarm val_drop: val/accuracy this far below its best so far")
    val_drop_action: AlarmAction = doc("warn", f"action of val_drop: {ACTION_HELP}")
    entropy_jump: float | None = doc(
        1.0, "alarm entropy_jump: policy/entropy above (1 + this) or below 1 / (1 + this) times its mean over the "
        "window's previous steps"
    )
    entropy_jump_action: AlarmAction = doc("warn", f"action of entropy_jump: {ACTION_HELP}")
    length_growth: float | None = doc(
        0.5, "alarm length_growth: response/length_mean above (1 + this) times its mean over the window's previous steps"
    )
    length_growth_action: AlarmAction = doc("warn", f"action of length_growth: {ACTION_HELP}")
    clip_fraction: float | None = doc(0.2, "alarm clip_fraction: loss/clip_fraction's mean over the window above this")
    clip_fraction_action: AlarmAction = doc("warn", f"action of clip_fraction: {ACTION_HELP}")
    importance_weight: float | None = doc(
        0.2, "alarm importance_weight: |loss/is_weight_mean - 1| (MIPU's importance weights) averaged over the window "
        "above this"
    )
    importance_weight_action: AlarmAction = doc("warn", f"action of importance_weight: {ACTION_HELP}")
    hack_rate: float | None = doc(
        0.1, "alarm hack_rate: audit/hack_rate (reward.audit_fns) averaged over the window above this"
    )
    hack_rate_action: AlarmAction = doc("warn", f"action of hack_rate: {ACTION_HELP}")

    def __post_init__(self) -> None:
        check_choices("monitor", self)
        require_at_least("monitor", self, ("window",), 1)
        for kind in self.alarm_kinds():
            threshold = getattr(self, kind)
            require(threshold is None or threshold >= 0, f"monitor.{kind} must be >= 0 (or null: off), got {threshold}")

    @classmethod
    def alarm_kinds(cls) -> tuple[str, ...]:
        """The alarm kinds this section configures: each field with a `<field>_action` beside it."""
        names = cls.__dataclass_fields__
        return tuple(name for name in names if f"{name}_action" in names)
