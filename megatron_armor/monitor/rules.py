"""The alarm kinds, registered by name: each is an `AlarmRule` subclass that reads a step's metrics, keeps what it
needs in `Window`s (its checkpointed state) and says whether its condition holds.

A rule whose metric is absent on a step (no validation ran, an algorithm without that statistic) observes nothing
on that step. Thresholds and actions come from the `monitor` section: field `<kind>` and its entry in `actions`.
Level alarms fire once a condition is reached (val_drop, hack_rate, ...); trend alarms fire while it is coming
(the least-squares slope of a metric over a window: hack_rate_trend, reward_gap_trend, length_trend, entropy_trend),
and val_drop_se measures the validation drop against the validation set's own noise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from megatron_armor.monitor.windows import Window

ALARM_RULES: dict[str, type[AlarmRule]] = {}


def register_alarm(cls: type[AlarmRule]) -> type[AlarmRule]:
    """Class decorator: make `cls` the rule of alarm `cls.kind`."""
    ALARM_RULES[cls.kind] = cls
    return cls


@dataclass(frozen=True)
class Observation:
    """What a rule saw on a step: its `monitor/*` metrics, whether its condition holds, and why (one line)."""

    metrics: dict[str, float] = field(default_factory=dict)
    breached: bool = False
    reason: str = ""


class AlarmRule:
    """One alarm kind: `observe` a step's metrics against `threshold`, with windows of `window` values.

    Subclasses set `kind`, build their `windows` in `__init__` and implement `observe`; their state is the windows'
    values (`state_dict`)."""

    kind: ClassVar[str]
    # the monitor setting that sizes its windows: `window` (steps, or validations), or `trend_window` (steps)
    window_setting: ClassVar[str] = "window"
    # windows that hold facts of the task rather than of the policy, kept when the policy is restarted (`rearm`)
    kept_on_rearm: ClassVar[tuple[str, ...]] = ()

    def __init__(self, threshold: float, window: int) -> None:
        self.threshold, self.size = threshold, window
        self.windows: dict[str, Window] = {}

    def rearm(self) -> None:
        """Forget what was seen of the policy before a restart (the anchor action's): every window but the
        `kept_on_rearm` ones empties, so a windowed alarm needs a full window of the new policy to fire."""
        for name, window in self.windows.items():
            if name not in self.kept_on_rearm:
                window.values = []

    def observe(self, metrics: Mapping[str, float]) -> Observation | None:
        """The observation of a step's `metrics`, or None when the rule's metrics are absent."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {name: list(window.values) for name, window in self.windows.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name, window in self.windows.items():
            window.values = [float(v) for v in state.get(name, [])][-window.size :]


@register_alarm
class RewardGap(AlarmRule):
    """Training accuracy pulls away from validation accuracy: at each validation, gap = mean train/accuracy over
    the window's steps - val/accuracy; fires while gap > threshold and the gap's slope over the window's
    validations is positive (train/accuracy, not train/reward_mean: the same scale as val/accuracy, no overlong
    penalty)."""

    kind = "reward_gap"

    def __init__(self, threshold: float, window: int) -> None:
        super().__init__(threshold, window)
        self.train, self.gaps = Window(window), Window(window)
        self.windows = {"train_accuracy": self.train, "gaps": self.gaps}

    def breaches(self, gap: float, trend: float) -> bool:
        return gap > self.threshold and len(self.gaps.values) >= 2 and trend > 0

    def describe(self, train: float, val: float, gap: float, trend: float) -> str:
        return (f"train/accuracy {train:.3f} (mean of {len(self.train.values)} steps) exceeds val/accuracy "
                f"{val:.3f} by {gap:.3f} > {self.threshold}, widening by {trend:+.3f} per validation")

    def observe(self, metrics: Mapping[str, float]) -> Observation | None:
        if "train/accuracy" in metrics:
            self.train.push(metrics["train/accuracy"])
        if "val/accuracy" not in metrics or not self.train.values:
            return None
        train, val = self.train.mean(), metrics["val/accuracy"]
        self.gaps.push(train - val)
        gap, trend = train - val, self.gaps.slope()
        return Observation({"monitor/reward_gap": gap, "monitor/reward_gap_trend": trend}, self.breaches(gap, trend),
                           self.describe(train, val, gap, trend))


@register_alarm
class RewardGapTrend(RewardGap):
    """The train/validation gap widens, whatever its size: fires while the gap's slope over a full window of
    validations exceeds threshold (accuracy per validation), before the gap itself is large."""

    kind = "reward_gap_trend"

    def breaches(self, gap: float, trend: float) -> bool:
        return self.gaps.full and trend > self.threshold

    def describe(self, train: float, val: float, gap: float, trend: float) -> str:
        return (f"the gap of train/accuracy over val/accuracy ({gap:.3f} now) widens by {trend:+.3f} per validation "
                f"over the last {len(self.gaps.values)} validations (> {self.threshold})")


@register_alarm
class ValDrop(AlarmRule):
    """Validation accuracy falls from its best: fires while best - val/accuracy > threshold."""

    kind = "val_drop"
    kept_on_rearm = ("best",)  # the best validation so far is the bar a restarted policy is held to

    def __init__(self, threshold: float, window: int) -> None:
        super().__init__(threshold, window)
        self.best = Window(1)
        self.windows = {"best": self.best}

    def observe(self, metrics: Mapping[str, float]) -> Observation | None:
        if "val/accuracy" not in metrics:
            return None
        val = metrics["val/accuracy"]
        self.best.push(max([val, *self.best.values]))
        best = self.best.values[0]
        reason = f"val/accuracy {val:.3f} is {best - val:.3f} below its best {best:.3f} (> {self.threshold})"
        return Observation({"monitor/val_best": best, "monitor/val_drop": best - val}, best - val > self.threshold,
                           reason)


class RatioToRecent(AlarmRule):
    """A metric against its mean over the window's previous steps: ratio = value / that mean, once the window
    is full (and its mean positive); `breaches(ratio)` decides."""

    key: ClassVar[str]  # the metric watched
    name: ClassVar[str]  # logged as monitor/<name>_ratio

    def __init__(self, threshold: float, window: int) -> None:
        super().__init__(threshold, window)
        self.history = Window(window)
        self.windows = {"history": self.history}

    def breaches(self, ratio: float) -> bool:
        raise NotImplementedError

    def observe(self, metrics: Mapping[str, float]) -> Observation | None:
        if self.key not in metrics:
            return None
        value, baseline = metrics[self.key], self.history.mean()
        ready = self.history.full and baseline > 0
        self.history.push(value)
        if not ready:
            return Observation()
        ratio = value / baseline
        reason = (f"{self.key} {value:.4g} is {ratio:.2f}x its mean {baseline:.4g} over the previous "
                  f"{self.size} steps (threshold {self.threshold})")
        return Observation({f"monitor/{self.name}_ratio": ratio}, self.breaches(ratio), reason)


@register_alarm
class EntropyJump(RatioToRecent):
    """Policy entropy jumps or collapses: ratio > 1 + threshold or < 1 / (1 + threshold)."""

    kind, key, name = "entropy_jump", "policy/entropy", "entropy"

    def breaches(self, ratio: float) -> bool:
        return ratio > 1 + self.threshold or ratio < 1 / (1 + self.threshold)


@register_alarm
class LengthGrowth(RatioToRecent):
    """Responses grow fast: ratio of response/length_mean to its recent mean > 1 + threshold."""

    kind, key, name = "length_growth", "response/length_mean", "length"

    def breaches(self, ratio: float) -> bool:
        return ratio > 1 + self.threshold


class RecentValues(AlarmRule):
    """A per-step statistic (`value` of the metrics, named `what` in reasons) kept over the last `size` steps."""

    value: ClassVar[Callable[[Mapping[str, float]], float | None]]
    what: ClassVar[str]  # the statistic, for the reason

    def __init__(self, threshold: float, window: int) -> None:
        super().__init__(threshold, window)
        self.recent = Window(window)
        self.windows = {"recent": self.recent}

    def pushed(self, metrics: Mapping[str, float]) -> bool:
        """Push the step's statistic; False when the step has none (the rule observes nothing)."""
        value = self.value(metrics)
        if value is not None:
            self.recent.push(value)
        return value is not None


class WindowMean(RecentValues):
    """A per-step statistic averaged over the window: fires while the window is full and its mean > threshold;
    logged as monitor/<kind>_mean."""

    def observe(self, metrics: Mapping[str, float]) -> Observation | None:
        if not self.pushed(metrics):
            return None
        mean = self.recent.mean()
        reason = f"{self.what} averages {mean:.4g} over the last {len(self.recent.values)} steps (> {self.threshold})"
        return Observation({f"monitor/{self.kind}_mean": mean}, self.recent.full and mean > self.threshold, reason)


def _metric(key: str) -> Callable[[Mapping[str, float]], float | None]:
    return lambda metrics: metrics.get(key)


@register_alarm
class ClipFraction(WindowMean):
    """Many tokens hit the PPO clip: the policy moves far from the sampler each step."""

    kind, what, value = "clip_fraction", "loss/clip_fraction", staticmethod(_metric("loss/clip_fraction"))


IMPORTANCE_WEIGHTS = ("loss/is_weight_mean", "async/importance_weight_mean")  # MIPU's; the behaviour correction's


def _importance_weight_drift(metrics: Mapping[str, float]) -> float | None:
    """The largest |w - 1| of the step's mean importance weights (None when it logged neither)."""
    drifts = [abs(metrics[key] - 1) for key in IMPORTANCE_WEIGHTS if key in metrics]
    return max(drifts) if drifts else None


@register_alarm
class ImportanceWeight(WindowMean):
    """Importance weights drift from 1 (MIPU's, or the behaviour correction's of overlapped rollout modes): the
    trainer's and the sampler's policies disagree."""

    kind, what = "importance_weight", "max |importance weight mean - 1|"
    value = staticmethod(_importance_weight_drift)


@register_alarm
class HackRate(WindowMean):
    """Audit verifiers disagree with the training verifier on samples it calls correct (reward.audit_fns)."""

    kind, what, value = "hack_rate", "audit/hack_rate", staticmethod(_metric("audit/hack_rate"))


@register_alarm
class ValDropStdErr(AlarmRule):
    """Validation accuracy falls from its best by more than its noise; logged as monitor/val_drop_se (the drop in
    standard errors).

    Each validation logs its standard error se (val/accuracy_stderr, from the spread of its per-prompt accuracies
    and its number of samples). The best so far is the maximum of k noisy validations, biased upwards by up to
    se_best * sqrt(2 ln k) (the expected maximum of k standard normals is below sqrt(2 ln k)); the rule takes that
    off and fires while (best - se_best * sqrt(2 ln k)) - val/accuracy > threshold * sqrt(se_best^2 + se^2). So a
    healthy run's noise does not fire it however long it runs, a small validation set (large se) needs a larger
    drop, and a large one (small se) fires on a smaller drop than val_drop's fixed threshold.
    """

    kind = "val_drop_se"
    kept_on_rearm = ("best", "validations")  # facts of the task: the bar a restarted policy is held to

    def __init__(self, threshold: float, window: int) -> None:
        super().__init__(threshold, window)
        self.best = Window(2)  # [best val/accuracy, its standard error]
        self.validations = Window(1)  # [validations seen]
        self.windows = {"best": self.best, "validations": self.validations}

    def observe(self, metrics: Mapping[str, float]) -> Observation | None:
        if "val/accuracy" not in metrics or "val/accuracy_stderr" not in metrics:
            return None
        val, stderr = metrics["val/accuracy"], metrics["val/accuracy_stderr"]
        seen = int(self.validations.values[0]) + 1 if self.validations.values else 1
        self.validations.push(seen)
        if not self.best.values or val > self.best.values[0]:
            self.best.values = [val, stderr]
        best, best_stderr = self.best.values
        bar = best - best_stderr * math.sqrt(2 * math.log(seen))
        noise, drop = math.hypot(best_stderr, stderr), bar - val
        in_errors = drop / noise if noise > 0 else (math.inf if drop > 0 else 0.0)
        reason = (f"val/accuracy {val:.3f} is {in_errors:.1f} standard errors (noise {noise:.3f}) below its best "
                  f"{best:.3f} less its selection bias over {seen} validations ({bar:.3f}) (> {self.threshold})")
        return Observation({"monitor/val_drop_se": max(min(in_errors, 1e6), -1e6)}, in_errors > self.threshold, reason)


class Trend(RecentValues):
    """A per-step statistic's least-squares slope over the last `trend_window` steps (per step; divided by the
    window's mean when `relative`): fires while the window is full and the slope (its size, when `two_sided`) >
    threshold; logged as monitor/<kind>."""

    window_setting = "trend_window"
    relative: ClassVar[bool] = False
    two_sided: ClassVar[bool] = False

    def observe(self, metrics: Mapping[str, float]) -> Observation | None:
        if not self.pushed(metrics):
            return None
        mean = self.recent.mean()
        if not self.recent.full or (self.relative and mean <= 0):
            return Observation()
        slope = self.recent.slope() / (mean if self.relative else 1.0)
        size = abs(slope) if self.two_sided else slope
        unit = "of its mean per step" if self.relative else "per step"
        reason = (f"{self.what} moves by {slope:+.4g} {unit} over the last {self.size} steps (threshold "
                  f"{self.threshold})")
        return Observation({f"monitor/{self.kind}": slope}, size > self.threshold, reason)


@register_alarm
class HackRateTrend(Trend):
    """The audits' hack rate climbs: the exploit is spreading, before its level reaches hack_rate's threshold."""

    kind, what, value = "hack_rate_trend", "audit/hack_rate", staticmethod(_metric("audit/hack_rate"))


@register_alarm
class LengthTrend(Trend):
    """Responses lengthen steadily (relative slope of response/length_mean), a common sign of a length exploit."""

    kind, what, value = "length_trend", "response/length_mean", staticmethod(_metric("response/length_mean"))
    relative = True


@register_alarm
class EntropyTrend(Trend):
    """Policy entropy drifts steadily up or down (relative slope of policy/entropy, either sign): collapse onto one
    answer pattern, or a policy coming apart."""

    kind, what, value = "entropy_trend", "policy/entropy", staticmethod(_metric("policy/entropy"))
    relative, two_sided = True, True
