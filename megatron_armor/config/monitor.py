"""The `monitor` section: the collapse monitor's alarms (megatron_armor.monitor), each a threshold and an action."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_armor.config.base import doc, require, require_at_least
from megatron_armor.config.builders import Buildable

# anchor: ARMOR restarted from the best checkpoint; anchor_keep: ARMOR from the current weights with the best checkpoint
# as the reference (trainer/guard/anchor_switch.py)
ANCHOR_ACTIONS = ("anchor", "anchor_keep")
ACTIONS = ("warn", "stop", *ANCHOR_ACTIONS)
SETTINGS = ("enabled", "window", "trend_window", "actions", "reference_reset")  # every other field is an alarm's threshold


@dataclass
class MonitorConfig(Buildable):
    """Which alarms the collapse monitor raises and what each does. Alarm <kind> has a threshold, field `<kind>`
    (null: off), and an action in `actions` (default warn); it fires (monitor/alarm_<kind> = 1) on the step its
    condition starts to hold, and again only after it stopped holding."""

    component = "megatron_armor.trainer.guard.collapse_watch:CollapseWatch"

    enabled: bool | None = doc(
        None, "watch every step's metrics for over-optimization and log monitor/*; null: on when the run validates "
        "(data.val_path or eval.datasets), every alarm warning unless `actions` says otherwise; false: off (none logged)"
    )
    window: int = doc(
        5, "steps in the windows of the per-step alarms (means, and the baseline jumps are measured against), and "
        "validations in the reward-gap trend"
    )
    trend_window: int = doc(
        20, "steps over which the trend alarms (hack_rate_trend, length_trend, entropy_trend) fit their slope"
    )
    actions: list[str] = doc(
        [], "per-alarm actions as <kind>=<action>, e.g. [hack_rate=stop, val_drop=stop]; an alarm not listed warns. "
        "warn: log the alarm's reason and go on; stop: checkpoint, then exit with an error naming the alarm; anchor: "
        "ARMOR's restart (armor.md §4), automatic: actor and reference go back to the best checkpoint "
        "(checkpoint.keep_best), the optimizer and lr warmup start afresh, and training goes on as ARMOR (armor.alpha, "
        "rollout.anchors.ref_n, groups of the run's on-policy samples + 1 anchor); from grpo / grpo_kl it switches, "
        "under armor (and after a switch) it resets policy and reference to the best checkpoint again; anchor_keep: "
        "the gentle one, the current weights, optimizer and lr schedule go on and only the reference becomes the best "
        "checkpoint's, as ARMOR from then on (no progress thrown away; with both actions among a step's alarms, anchor "
        "wins). The best checkpoint may be the start: the model the run started from, with its step-0 validation"
    )
    reference_reset: bool = doc(
        False, "at a validation that sets a new best val/accuracy while no alarm holds, the reference becomes the "
        "current policy (ARMOR's periodic reset, armor.md §4, timed by the monitor); for runs that have a reference "
        "(armor, grpo_kl, and a run the anchor action switched)"
    )
    reward_gap: float | None = doc(
        0.2, "alarm reward_gap: train/accuracy (mean over the window's steps) minus val/accuracy above this while the "
        "gap widens (positive slope over the window's validations)"
    )
    reward_gap_trend: float | None = doc(
        0.03, "alarm reward_gap_trend: the train/accuracy - val/accuracy gap widens faster than this per validation "
        "(slope over a full window of validations), whatever its size: the exploit is starting"
    )
    val_drop: float | None = doc(0.1, "alarm val_drop: val/accuracy this far below its best so far")
    val_drop_se: float | None = doc(
        3.0, "alarm val_drop_se: val/accuracy below its best by more than this many standard errors of the "
        "difference (each validation's val/accuracy_stderr, from its per-prompt accuracies and sample count), so "
        "small validation sets do not fire on noise"
    )
    clip_fraction: float | None = doc(0.2, "alarm clip_fraction: loss/clip_fraction's mean over the window above this")
    entropy_jump: float | None = doc(
        1.0, "alarm entropy_jump: policy/entropy above (1 + this) or below 1 / (1 + this) times its mean over the "
        "window's previous steps"
    )
    length_growth: float | None = doc(
        0.5, "alarm length_growth: response/length_mean above (1 + this) times its mean over the window's previous steps"
    )
    importance_weight: float | None = doc(
        0.2, "alarm importance_weight: the larger |w - 1| of loss/is_weight_mean (MIPU's importance weights) and "
        "async/importance_weight_mean (the behaviour correction's) averaged over the window above this"
    )
    hack_rate: float | None = doc(0.1, "alarm hack_rate: audit/hack_rate (reward.audit_fns) averaged over the window above this")
    hack_rate_trend: float | None = doc(
        0.002, "alarm hack_rate_trend: audit/hack_rate rises faster than this per step (slope over trend_window "
        "steps): the exploit spreading before its level reaches hack_rate"
    )
    length_trend: float | None = doc(
        0.02, "alarm length_trend: response/length_mean grows faster than this fraction of its mean per step (slope "
        "over trend_window steps)"
    )
    entropy_trend: float | None = doc(
        0.05, "alarm entropy_trend: policy/entropy moves (up or down) faster than this fraction of its mean per step "
        "(slope over trend_window steps)"
    )

    def __post_init__(self) -> None:
        require_at_least("monitor", self, ("window",), 1)
        require_at_least("monitor", self, ("trend_window",), 2)  # a slope needs two points
        for kind in self.alarm_kinds():
            threshold = getattr(self, kind)
            require(threshold is None or threshold >= 0, f"monitor.{kind} must be >= 0 (or null: off), got {threshold}")
        self.action_of()  # every entry of `actions` names a kind and an allowed action

    def check_with(self, keep_best: str | None) -> None:
        """The anchor actions go back to the best checkpoint: checkpoint.`keep_best` must keep one."""
        require(not self.anchors or keep_best is not None,
                "monitor.actions: anchor and anchor_keep go back to the best checkpoint (anchor restarts from it, "
                "anchor_keep makes it the reference): set checkpoint.keep_best (e.g. val/accuracy)")

    @classmethod
    def alarm_kinds(cls) -> tuple[str, ...]:
        """The alarm kinds this section configures: every field but the monitor's own settings."""
        return tuple(name for name in cls.__dataclass_fields__ if name not in SETTINGS)

    def action_of(self) -> dict[str, str]:
        """{kind: action} of every alarm kind, from `actions` (warn where not listed)."""
        actions = dict.fromkeys(self.alarm_kinds(), "warn")
        for entry in self.actions:
            kind, sep, action = (part.strip() for part in entry.partition("="))
            require(bool(sep) and kind in actions, f"monitor.actions: {entry!r} must look like <kind>=<action> with a "
                                                   f"kind of {list(actions)}")
            require(action in ACTIONS, f"monitor.actions: {entry!r}: action {action!r} is not allowed; choose one of "
                                       f"{list(ACTIONS)}")
            actions[kind] = action
        return actions

    def runs(self, *, validates: bool) -> bool:
        """Whether the monitor watches a run that validates (`validates`) or not: `enabled`, by default on with
        validation (the alarms watch validation; a run without it gets none of them)."""
        return self.enabled if self.enabled is not None else validates

    @property
    def anchors(self) -> bool:
        """Whether an alarm's action is anchor or anchor_keep (and the monitor is not off): the run may switch to
        ARMOR."""
        return self.enabled is not False and any(action in ANCHOR_ACTIONS for action in self.action_of().values())

    @property
    def keeps_weights_on_anchor(self) -> bool:
        """Whether an alarm's action is anchor_keep (and the monitor is not off): the reference may become another
        model than the start's."""
        return self.enabled is not False and "anchor_keep" in self.action_of().values()
