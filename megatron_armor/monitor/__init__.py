"""The collapse monitor: watches each step's metrics for over-optimization (training reward rising while held-out
accuracy falls) and raises named alarms.

    windows.py   bounded, checkpointable windows of a metric and the trend over one
    rules.py     the registered alarm kinds (`register_alarm`), one rule object per kind
    collapse.py  CollapseMonitor: the rules the `monitor` section turns on, their actions, its state
"""

from megatron_armor.monitor.collapse import Alarm, CollapseAlarmError, CollapseMonitor, MonitorReport
from megatron_armor.monitor.rules import ALARM_RULES, AlarmRule, register_alarm

__all__ = ["ALARM_RULES", "Alarm", "AlarmRule", "CollapseAlarmError", "CollapseMonitor", "MonitorReport",
           "register_alarm"]
