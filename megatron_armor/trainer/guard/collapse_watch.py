"""The collapse monitor in the run loop: each step's metrics (with its validation's) go through the
`CollapseMonitor` (megatron_armor.monitor), its `monitor/*` metrics join them, the alarms are logged, and the
alarms whose action is stop or anchor are agreed on by every rank. Off (`monitor.enabled` false, or left unset in a run
without validation), it adds nothing."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from megatron_armor.config import MonitorConfig
from megatron_armor.config.builders import builds
from megatron_armor.distributed.reduce import any_rank
from megatron_armor.monitor import Alarm, CollapseMonitor

log = logging.getLogger("megatron_armor")

STATE_KEY = "monitor"  # the monitor's entry in a checkpoint's trainer state (under "extra" in trainer_state.json)


@dataclass(frozen=True)
class WatchVerdict:
    """What a step's alarms ask the run loop to do, the same on every rank: stop (checkpoint and raise), anchor
    (trainer/guard/anchor_switch.py). Each holds the alarms of that action (another rank's: kind "other_rank")."""

    stopping: tuple[Alarm, ...] = ()
    anchoring: tuple[Alarm, ...] = ()  # alarms whose action is anchor or anchor_keep
    restarting: bool = False  # one of them (on any rank) is anchor: restart from the best checkpoint, not keep


@builds(MonitorConfig)
class CollapseWatch:
    """Runs a `CollapseMonitor` when the section turns it on for the run (`MonitorConfig.runs`: by default when it
    validates); its state travels with the checkpoints (`state`, `load`)."""

    def __init__(self, cfg: MonitorConfig, *, validates: bool, is_main: bool) -> None:
        self.monitor = CollapseMonitor(cfg) if cfg.runs(validates=validates) else None
        self.is_main = is_main

    @property
    def quiet(self) -> bool:
        """Whether the monitor runs and no alarm's condition holds (the same on every rank: the metrics it watches
        are reduced over ranks)."""
        return self.monitor is not None and not self.monitor.active

    def observe(self, step: int, metrics: dict[str, float]) -> WatchVerdict:
        """Feed step `step`'s metrics, add the monitor's to them, log each alarm that fired (main rank); the alarms
        whose action is stop or anchor (collective when enabled: every rank acts if any rank's monitor says so)."""
        if self.monitor is None:
            return WatchVerdict()
        report = self.monitor.observe(metrics)
        metrics.update(report.metrics)
        if self.is_main:
            for alarm in report.alarms:
                log.warning("step %d: collapse monitor: %s", step, alarm.describe())
        anchoring = _agreed(report.acting("anchor") + report.acting("anchor_keep"), "anchor")
        return WatchVerdict(stopping=_agreed(report.acting("stop"), "stop"), anchoring=anchoring,
                            restarting=bool(anchoring) and any_rank(bool(report.acting("anchor"))))

    def rearm(self) -> None:
        """After the anchor action restarted the run: every alarm may fire again (`CollapseMonitor.rearm`)."""
        if self.monitor is not None:
            self.monitor.rearm()

    def state(self) -> dict[str, Any]:
        """The entries the monitor adds to a checkpoint's trainer state ({} when off)."""
        return {} if self.monitor is None else {STATE_KEY: self.monitor.state_dict()}

    def load(self, state: dict[str, Any]) -> None:
        """Restore the monitor from a checkpoint's trainer state (one saved without it: the monitor starts afresh)."""
        if self.monitor is not None and STATE_KEY in state:
            self.monitor.load_state_dict(state[STATE_KEY])


def _agreed(alarms: tuple[Alarm, ...], action: str) -> tuple[Alarm, ...]:
    """This rank's alarms of `action`, or one standing for another rank's when only other ranks' fired; () when no
    rank's did (collective)."""
    if not any_rank(bool(alarms)):
        return ()
    return alarms or (Alarm("other_rank", f"another rank's monitor fired ({action})", action),)
