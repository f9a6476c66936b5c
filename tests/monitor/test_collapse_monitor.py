"""The collapse monitor on synthetic metric streams: a planted divergence fires, healthy runs do not, each alarm
kind fires on its own condition, and the monitor's state survives a checkpoint round trip."""

import json
import random

import pytest

from megatron_armor.config import ConfigError, MonitorConfig
from megatron_armor.monitor import ALARM_RULES, CollapseMonitor

EVAL_EVERY = 5


def run(monitor: CollapseMonitor, stream) -> list[tuple[int, str]]:
    """Feed (step, metrics) pairs; the (step, kind) of every alarm that fired."""
    fired = []
    for step, metrics in stream:
        report = monitor.observe(metrics)
        fired += [(step, alarm.kind) for alarm in report.alarms]
        for kind in monitor.rules:
            assert report.metrics[f"monitor/alarm_{kind}"] == float(any(a.kind == kind for a in report.alarms))
    return fired


VAL_STDERR = 0.03  # val/accuracy_stderr of the streams' validations (a few hundred prompts)


def accuracy_stream(train_acc, val_acc, steps=60, seed=0, noise=0.0):
    """Per-step train/accuracy (+ healthy entropy, length, clip, hack rate) and val/accuracy (with its standard
    error) every EVAL_EVERY steps."""
    rng = random.Random(seed)
    for step in range(1, steps + 1):
        metrics = {
            "train/accuracy": train_acc(step) + rng.uniform(-noise, noise),
            "policy/entropy": 0.5 + rng.uniform(-0.05, 0.05),
            "response/length_mean": 100 + rng.uniform(-5, 5),
            "loss/clip_fraction": 0.02,
            "audit/hack_rate": rng.uniform(0.0, 0.04),
        }
        if step % EVAL_EVERY == 0:
            metrics["val/accuracy"] = val_acc(step) + rng.uniform(-noise, noise)
            metrics["val/accuracy_stderr"] = VAL_STDERR
        yield step, metrics


def test_planted_divergence_fires_the_trend_before_the_levels():
    stream = accuracy_stream(lambda s: min(0.3 + 0.012 * s, 0.95),
                             lambda s: 0.3 + 0.01 * s if s <= 20 else max(0.5 - 0.02 * (s - 20), 0.0))
    fired = run(CollapseMonitor(MonitorConfig(enabled=True)), stream)
    assert fired[0] == (25, "reward_gap_trend")  # the first validation after the divergence starts
    assert {kind for _, kind in fired} == {"reward_gap_trend", "reward_gap", "val_drop", "val_drop_se"}, fired
    assert all(step >= 30 for step, kind in fired if kind != "reward_gap_trend")  # the levels: a validation later
    assert all(step > 20 for step, _ in fired)  # nothing before the divergence starts
    assert [kind for _, kind in fired].count("val_drop") == 1  # a lasting condition warns once


def test_rearmed_alarms_fire_again_while_their_condition_still_holds():
    """The anchor action re-arms the monitor after its restart: a lasting drop then fires once more."""
    stream = list(accuracy_stream(lambda s: 0.5, lambda s: 0.6 if s <= 10 else 0.3))
    monitor = CollapseMonitor(MonitorConfig(enabled=True, reward_gap=None, reward_gap_trend=None))
    assert run(monitor, stream[:20]) == [(15, "val_drop"), (15, "val_drop_se")]
    assert run(monitor, stream[20:30]) == []  # the drop lasts: it warned once
    monitor.rearm()
    # the best (0.6, with its standard error) is kept: the next validation fires
    assert run(monitor, stream[30:]) == [(35, "val_drop"), (35, "val_drop_se")]


def test_rearmed_window_alarms_wait_for_a_full_window_of_the_restarted_policy():
    monitor = single("hack_rate", 0.1, window=3)
    hacking = [(step, {"audit/hack_rate": 0.3}) for step in range(1, 11)]
    assert run(monitor, hacking[:5]) == [(3, "hack_rate")]
    monitor.rearm()
    assert run(monitor, hacking[5:]) == [(8, "hack_rate")]  # steps 6-8 are the new window


@pytest.mark.parametrize("noise", [0.0, 0.05])
def test_healthy_runs_do_not_fire(noise):
    rising = accuracy_stream(lambda s: 0.3 + 0.008 * s, lambda s: 0.28 + 0.008 * s, noise=noise, seed=1)
    flat = accuracy_stream(lambda s: 0.5, lambda s: 0.5, noise=noise, seed=2)
    for stream in (rising, flat):
        assert run(CollapseMonitor(MonitorConfig(enabled=True)), stream) == []


def single(kind: str, threshold: float, window: int = 3) -> CollapseMonitor:
    """A monitor with only alarm `kind` on."""
    off = {k: None for k in MonitorConfig.alarm_kinds() if k != kind}
    return CollapseMonitor(MonitorConfig(enabled=True, window=window, trend_window=window, **off, **{kind: threshold}))


def steps(key: str, values):
    return [(i, {key: v}) for i, v in enumerate(values, start=1)]


def test_every_configured_alarm_kind_has_a_rule():
    assert set(MonitorConfig.alarm_kinds()) == set(ALARM_RULES)


@pytest.mark.parametrize(("kind", "stream", "expected"), [
    ("reward_gap", [(1, {"train/accuracy": 0.5, "val/accuracy": 0.45}), (2, {"train/accuracy": 0.7, "val/accuracy": 0.4}),
                    (3, {"train/accuracy": 0.9, "val/accuracy": 0.3})], [(3, "reward_gap")]),
    ("val_drop", steps("val/accuracy", [0.4, 0.6, 0.55, 0.45, 0.7, 0.5]), [(4, "val_drop"), (6, "val_drop")]),
    ("entropy_jump", steps("policy/entropy", [0.5, 0.5, 0.5, 0.55, 1.2, 0.5, 0.5, 0.1]),
     [(5, "entropy_jump"), (8, "entropy_jump")]),
    ("length_growth", steps("response/length_mean", [100, 100, 100, 120, 200]), [(5, "length_growth")]),
    ("clip_fraction", steps("loss/clip_fraction", [0.1, 0.3, 0.3, 0.3, 0.1]), [(3, "clip_fraction")]),
    ("importance_weight", steps("loss/is_weight_mean", [1.0, 1.3, 1.4, 1.5]), [(3, "importance_weight")]),
    ("importance_weight", [(s, {"loss/is_weight_mean": 1.0, "async/importance_weight_mean": w})  # the behaviour
                           for s, w in enumerate([1.0, 0.6, 0.7, 1.0], start=1)], [(3, "importance_weight")]),
    ("hack_rate", steps("audit/hack_rate", [0.0, 0.05, 0.2, 0.3, 0.0, 0.0, 0.0]), [(4, "hack_rate")]),
    ("reward_gap_trend", [(s, {"train/accuracy": 0.5, "val/accuracy": v}) for s, v in enumerate(
        [0.5, 0.5, 0.45, 0.40, 0.40, 0.40], start=1)], [(4, "reward_gap_trend")]),  # slope 0.05, then 0.025, 0
    ("val_drop_se", [(s, {"val/accuracy": v, "val/accuracy_stderr": 0.02}) for s, v in enumerate(
        [0.5, 0.46, 0.5, 0.38, 0.5, 0.3], start=1)], [(4, "val_drop_se"), (6, "val_drop_se")]),
    ("hack_rate_trend", steps("audit/hack_rate", [0.0, 0.0, 0.0, 0.005, 0.01, 0.01, 0.01]), [(4, "hack_rate_trend")]),
    ("length_trend", steps("response/length_mean", [100, 100, 104, 110, 110, 110]), [(4, "length_trend")]),
    ("entropy_trend", steps("policy/entropy", [0.5, 0.5, 0.5, 0.45, 0.4, 0.4, 0.4, 0.5, 0.6]),
     [(4, "entropy_trend"), (8, "entropy_trend")]),  # -0.025 / 0.483 per step, then +0.05 / 0.433
])
def test_each_alarm_kind_fires_on_its_condition(kind, stream, expected):
    threshold = {"reward_gap": 0.2, "val_drop": 0.1, "entropy_jump": 1.0, "length_growth": 0.5, "clip_fraction": 0.2,
                 "importance_weight": 0.2, "hack_rate": 0.1, "reward_gap_trend": 0.03, "val_drop_se": 3.0,
                 "hack_rate_trend": 0.002, "length_trend": 0.02, "entropy_trend": 0.05}[kind]
    assert run(single(kind, threshold), stream) == expected


TREND_STEPS = 200


def trend_stream(seed: int, start: int | None):
    """TREND_STEPS steps of healthy per-step noise (hack rate U(0, 0.04), length 100 +- 10%, entropy 0.5 +- 10%);
    from step `start` on (None: never) the hack rate rises 0.01, the length 3% and the entropy falls 8% per step."""
    rng = random.Random(seed)
    for step in range(1, TREND_STEPS + 1):
        ramp = 0 if start is None or step < start else step - start
        yield step, {"audit/hack_rate": min(rng.uniform(0.0, 0.04) + 0.01 * ramp, 1.0),
                     "response/length_mean": 100 * 1.03 ** ramp * rng.uniform(0.9, 1.1),
                     "policy/entropy": 0.5 * 0.92 ** ramp * rng.uniform(0.9, 1.1)}


TRENDS = ("hack_rate_trend", "length_trend", "entropy_trend")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_trend_alarms_fire_while_the_trend_starts_and_not_on_noise(seed):
    defaults = MonitorConfig(enabled=True)  # the documented defaults, trend_window 20
    levels_off = {kind: None for kind in MonitorConfig.alarm_kinds() if kind not in TRENDS}
    assert run(CollapseMonitor(MonitorConfig(enabled=True, **levels_off)), trend_stream(seed, None)) == []
    fired = run(CollapseMonitor(MonitorConfig(enabled=True, **levels_off)), trend_stream(seed, 100))
    first = {kind: min(step for step, k in fired if k == kind) for kind in TRENDS}
    assert all(100 < step <= 100 + defaults.trend_window for step in first.values()), fired
    # the hack rate's level alarm (0.1 over its window of 5) comes later than its trend (a slope of 0.002 per step)
    level = run(single("hack_rate", defaults.hack_rate, window=defaults.window), trend_stream(seed, 100))
    assert first["hack_rate_trend"] < level[0][0] - 2


def validations(stderr: float, count: int, seed: int, drop_at: int | None = None, drop: float = 0.0):
    """`count` validations of true accuracy 0.5 measured with Gaussian noise of standard error `stderr` (logged as
    val/accuracy_stderr); from validation `drop_at` on, the true accuracy is `drop` lower."""
    rng = random.Random(seed)
    for i in range(1, count + 1):
        true = 0.5 - (drop if drop_at is not None and i >= drop_at else 0.0)
        yield i, {"val/accuracy": rng.gauss(true, stderr), "val/accuracy_stderr": stderr}


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_val_drop_se_fires_on_a_real_drop_not_on_the_validation_noise(seed):
    threshold = MonitorConfig().val_drop_se
    for stderr in (0.03, 0.15):  # 100 healthy validations of a large and of a small validation set
        assert run(single("val_drop_se", threshold), validations(stderr, 100, seed)) == []
    assert run(single("val_drop", 0.1), validations(0.15, 100, seed))  # the fixed level fires on the small set's noise
    fired = run(single("val_drop_se", threshold), validations(0.02, 40, seed, drop_at=20, drop=0.15))
    assert fired and 20 <= fired[0][0] <= 21, fired


def test_reward_gap_needs_a_widening_gap():
    stream = [(s, {"train/accuracy": 0.9, "val/accuracy": 0.5}) for s in range(1, 6)]  # wide but steady
    assert run(single("reward_gap", 0.2), stream) == []


def test_alarm_reason_and_action():
    monitor = CollapseMonitor(MonitorConfig(enabled=True, val_drop=0.1, actions=["val_drop=stop"]))
    monitor.observe({"val/accuracy": 0.6})
    report = monitor.observe({"val/accuracy": 0.4})
    (alarm,) = report.stopping
    assert alarm.kind == "val_drop" and "0.400 is 0.200 below its best 0.600" in alarm.reason
    assert report.metrics["monitor/val_best"] == 0.6
    assert report.metrics["monitor/val_drop"] == pytest.approx(0.2)


def test_state_round_trip_continues_as_if_not_stopped():
    stream = list(accuracy_stream(lambda s: min(0.3 + 0.012 * s, 0.95),
                                  lambda s: 0.3 + 0.01 * s if s <= 20 else max(0.5 - 0.02 * (s - 20), 0.0)))
    whole = CollapseMonitor(MonitorConfig(enabled=True))
    expected = run(whole, stream)
    first = CollapseMonitor(MonitorConfig(enabled=True))
    fired = run(first, stream[:24])
    resumed = CollapseMonitor(MonitorConfig(enabled=True))
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as trainer_state.json stores it
    assert fired + run(resumed, stream[24:]) == expected


def test_monitor_config_validation():
    with pytest.raises(ConfigError, match="monitor.window must be >= 1"):
        MonitorConfig(window=0)
    with pytest.raises(ConfigError, match="monitor.hack_rate must be >= 0"):
        MonitorConfig(hack_rate=-0.1)
    with pytest.raises(ConfigError, match="monitor.actions: 'val_drop=rollback': action 'rollback' is not allowed"):
        MonitorConfig(actions=["val_drop=rollback"])
    assert MonitorConfig(enabled=True, actions=["val_drop=anchor"]).anchors
    assert MonitorConfig(actions=["val_drop=anchor_keep"]).anchors  # on by default
    assert not MonitorConfig(enabled=False, actions=["val_drop=anchor"]).anchors  # the monitor is off
    with pytest.raises(ConfigError, match="monitor.actions: 'drift=stop' must look like <kind>=<action>"):
        MonitorConfig(actions=["drift=stop"])
    assert MonitorConfig(actions=["hack_rate = stop"]).action_of()["hack_rate"] == "stop"
    assert set(MonitorConfig().action_of().values()) == {"warn"}


def test_the_monitor_is_on_by_default_when_the_run_validates():
    assert MonitorConfig().runs(validates=True) and not MonitorConfig().runs(validates=False)
    assert not MonitorConfig(enabled=False).runs(validates=True)
    assert MonitorConfig(enabled=True).runs(validates=False)
