"""`CollapseMonitor`: feeds each step's metrics to the alarm rules the `monitor` section turns on, logs their
`monitor/*` metrics and reports the alarms that fire, with their actions."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_armor.config import MonitorConfig
from megatron_armor.monitor.rules import ALARM_RULES, AlarmRule


@dataclass(frozen=True)
class Alarm:
    """An alarm that fired: its kind, the one-line reason and the configured action ("warn" | "stop" | "anchor")."""

    kind: str
    reason: str
    action: str

    def describe(self) -> str:
        return f"alarm {self.kind} ({self.action}): {self.reason}"


@dataclass(frozen=True)
class MonitorReport:
    """A step's `monitor/*` metrics and the alarms that fired on it."""

    metrics: dict[str, float] = field(default_factory=dict)
    alarms: tuple[Alarm, ...] = ()

    @property
    def stopping(self) -> tuple[Alarm, ...]:
        """The fired alarms whose action is stop."""
        return self.acting("stop")

    def acting(self, action: str) -> tuple[Alarm, ...]:
        """The fired alarms whose action is `action`."""
        return tuple(alarm for alarm in self.alarms if alarm.action == action)


class CollapseAlarmError(RuntimeError):
    """The run stopped on collapse-monitor alarms whose action is stop, after checkpointing."""

    def __init__(self, step: int, alarms: tuple[Alarm, ...], checkpoint: Path) -> None:
        self.step, self.alarms, self.checkpoint = step, alarms, checkpoint
        fired = "; ".join(alarm.describe() for alarm in alarms)
        super().__init__(f"step {step}: the collapse monitor stopped the run: {fired}. Checkpoint: {checkpoint} "
                         f"(resume with --resume after changing monitor.<kind>_action, or restart from an earlier "
                         f"checkpoint)")


class CollapseMonitor:
    """Watches a run's metrics, step after step, with one rule per alarm kind whose threshold is set.

    An alarm fires (`monitor/alarm_<kind>` = 1) on the step its rule's condition starts to hold and again only after
    it stopped holding (`active`), so a lasting condition warns once. `state_dict` holds the rules' windows and the
    active kinds (JSON-able), so a resumed run goes on watching as if it had not stopped."""

    def __init__(self, cfg: MonitorConfig) -> None:
        kinds = [kind for kind in MonitorConfig.alarm_kinds() if getattr(cfg, kind) is not None]
        unknown = sorted(set(kinds) - set(ALARM_RULES))
        if unknown:
            raise ValueError(f"monitor alarms {unknown} have no registered rule (megatron_armor.monitor.rules)")
        self.rules: dict[str, AlarmRule] = {
            kind: ALARM_RULES[kind](getattr(cfg, kind), getattr(cfg, ALARM_RULES[kind].window_setting)) for kind in kinds
        }
        self.actions = cfg.action_of()
        self.active: set[str] = set()

    def observe(self, metrics: Mapping[str, float]) -> MonitorReport:
        """Feed one step's metrics (its validation's too, when one ran); the step's report."""
        out: dict[str, float] = {}
        alarms = []
        for kind, rule in self.rules.items():
            observation = rule.observe(metrics)
            fired = False
            if observation is not None:
                out.update(observation.metrics)
                fired = observation.breached and kind not in self.active
                if fired:
                    alarms.append(Alarm(kind, observation.reason, self.actions[kind]))
                (self.active.add if observation.breached else self.active.discard)(kind)
            out[f"monitor/alarm_{kind}"] = float(fired)
        return MonitorReport(out, tuple(alarms))

    def rearm(self) -> None:
        """After the anchor action's restart (another policy): every alarm may fire again at its next breach, even
        one whose condition has held since it fired, on evidence of the new policy only (`AlarmRule.rearm`: the
        per-step windows start empty; the best validation so far stays)."""
        self.active.clear()
        for rule in self.rules.values():
            rule.rearm()

    def state_dict(self) -> dict[str, Any]:
        return {"rules": {kind: rule.state_dict() for kind, rule in self.rules.items()}, "active": sorted(self.active)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a `state_dict()`; rules it does not mention (turned on since) start empty."""
        for kind, rule in self.rules.items():
            rule.load_state_dict(state.get("rules", {}).get(kind, {}))
        self.active = set(state.get("active", ())) & set(self.rules)
