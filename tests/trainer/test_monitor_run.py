"""The collapse monitor, audit verifiers and per-step update geometry through `armor train`'s code path
(`run_training`): audit, monitor and geometry metrics in metrics.jsonl, and a `stop` alarm that must fire stops the run
with a checkpoint holding the monitor."""

import json
import logging
from pathlib import Path

import pytest

from megatron_armor.config import load_config
from megatron_armor.trainer.run.train import run_training

CONFIG = str(Path(__file__).parents[2] / "examples" / "tiny" / "armor.yaml")


def test_audits_and_monitor_log_metrics_and_a_stop_alarm_checkpoints_and_stops(synthetic_cache, tmp_path, caplog):
    audits = tmp_path / "audits.py"
    audits.write_text("def never(response, row):\n    return 0.0, False\n")
    run_dir = tmp_path / "run"
    cfg = load_config(CONFIG, [
        "algorithm.name=grpo", "rollout.sampling.n_samples=8", "rollout.sampling.actor_n=8",
        "parallel.tensor_parallel_size=1", f"task.cache_dir={synthetic_cache}", f"logging.run_dir={run_dir}",
        "task.num_train_rows=400", "task.num_val_rows=16", "eval.every=0", "eval.max_prompts=4",
        "checkpoint.save_model=false", "checkpoint.every=100", "train.max_steps=3", "logging.tensorboard=false",
        "logging.plot=false", "logging.progress_bar=false", "logging.update_geometry_every=1",
        f"reward.audit_fns=[megatron_armor.rewards.arithmetic:verify, {audits}:never]",
        # every sample the training verifier calls correct, `never` calls wrong: hack rate = train accuracy > 0,
        # so the window of 2 steps fills and fires at step 2
        "monitor.enabled=true", "monitor.window=2", "monitor.hack_rate=0.0", "monitor.actions=[hack_rate=stop]",
    ])
    with caplog.at_level(logging.WARNING, logger="megatron_armor"):
        assert run_training(cfg) == 1
    rows = {row["step"]: row for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == [0, 1, 2]
    assert rows[0]["monitor/val_best"] == rows[0]["val/accuracy"]
    for step in (1, 2):
        row = rows[step]
        assert row["audit/arithmetic_verify_accuracy"] == row["train/accuracy"]  # the training verifier itself
        assert row["audit/arithmetic_verify_hack_rate"] == 0.0
        assert row["audit/audits_never_accuracy"] == 0.0
        assert row["audit/audits_never_hack_rate"] == row["audit/hack_rate"] == row["train/accuracy"] > 0
        assert "monitor/clip_fraction_mean" in row and "monitor/alarm_reward_gap" in row
    # logging.update_geometry_every 1: each step's update geometry per layer type; after step 1 the drift from the
    # reference (the run's starting weights) is that step's update, relative to the same norm
    kinds = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    for step in (1, 2):
        row = rows[step]
        assert row["perf/update_geometry_seconds"] > 0
        assert all(row[f"geometry/{k}_rel_update"] > 0 for k in kinds)
        assert all(0 < row[f"geometry/{k}_changed_fraction"] <= 1 for k in kinds)
    assert all(rows[1][f"geometry/{k}_ref_drift"] == pytest.approx(rows[1][f"geometry/{k}_rel_update"], rel=1e-6)
               for k in kinds)
    assert rows[1]["monitor/alarm_hack_rate"] == 0.0 and rows[2]["monitor/alarm_hack_rate"] == 1.0
    assert "step 2: collapse monitor: alarm hack_rate (stop): audit/hack_rate averages" in caplog.text
    assert "CollapseAlarmError: step 2: the collapse monitor stopped the run: alarm hack_rate" in caplog.text
    state = json.loads((run_dir / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["extra"]["monitor"]["active"] == ["hack_rate"]
    assert len(state["extra"]["monitor"]["rules"]["hack_rate"]["recent"]) == 2
