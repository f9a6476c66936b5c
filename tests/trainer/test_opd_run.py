"""On-policy distillation through the trainer (TP=2, 2 gloo processes): the untrained tiny model
samples, the frozen warm-started model scores its tokens; and the `--algo` CLI shorthand."""

import json
import math
from pathlib import Path

import pytest
from launcher import run_workers

from megatron_armor.cli import build_parser, overrides_from_args
from megatron_armor.algorithms import check_algorithm_config
from megatron_armor.config import ConfigError, load_config

CONFIG = str(Path(__file__).parents[2] / "examples" / "tiny" / "opd.yaml")


def test_algo_shorthand_sets_the_algorithm():
    args = build_parser().parse_args(["train", "--config", CONFIG, "--algo", "opd"])
    assert overrides_from_args(args) == ["algorithm.name=opd"]


def test_opd_tp2_run_distils_the_teacher_into_the_student(synthetic_cache, tmp_path):
    run_dir = tmp_path / "run"
    run_workers(
        "train_run.py", 2, tmp_path / "w", CONFIG, f"task.cache_dir={synthetic_cache}", f"logging.run_dir={run_dir}",
        "task.num_train_rows=400", "task.num_val_rows=16", "train.max_steps=2", "train.train_batch_size=4",
        "train.gen_batch_size=4", "train.mini_batch_size=2", "eval.every=2", "eval.max_prompts=8",
        "checkpoint.every=2", "logging.tensorboard=false", "logging.plot=false",
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "val/accuracy" in rows[0] and "val/accuracy" in rows[2]
    for row in rows[1:]:
        for key in ("opd/reverse_kl", "loss/policy_loss", "loss/clip_fraction", "optim/grad_norm", "train/reward_mean"):
            assert math.isfinite(row[key]), (key, row)
        assert row["filter/prompts_kept"] == 4  # no prompt filtering
        assert row["opd/reverse_kl"] > 0.1  # an untrained student is far from the teacher
        assert row["mismatch/logprob_abs_diff"] < 1e-3  # fp32 engine


def test_opd_needs_a_teacher_outside_the_synthetic_task():
    with pytest.raises(ConfigError, match="opd.teacher_path is required for algorithm.name opd"):
        check_algorithm_config(load_config(None, ["model.path=/m", "data.train_path=/d.jsonl", "algorithm.name=opd",
                                                  "rollout.sampling.actor_n=16"]))
