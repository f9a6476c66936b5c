"""checkpoint.keep_best through `armor train`'s code path (`run_training`): with a checkpoint and a validation every
step and keep_last 1, the step with the best val/accuracy keeps its checkpoint, checkpoints/BEST names it, and
metrics.jsonl says so on the steps that chose it."""

import json
from pathlib import Path

import pytest

from megatron_armor.config import ConfigError, load_config
from megatron_armor.trainer.run.train import run_training

CONFIG = str(Path(__file__).parents[2] / "examples" / "tiny" / "armor.yaml")


def _overrides(cache: Path, run_dir: Path) -> list[str]:
    return [
        "algorithm.name=grpo", "rollout.sampling.n_samples=8", "rollout.sampling.actor_n=8",
        "parallel.tensor_parallel_size=1", f"task.cache_dir={cache}", f"logging.run_dir={run_dir}",
        "task.num_train_rows=400", "task.num_val_rows=16", "eval.every=1", "eval.max_prompts=8",
        "eval.before_train=false", "checkpoint.save_model=false", "checkpoint.every=1", "checkpoint.keep_last=1",
        "checkpoint.keep_best=val/accuracy", "train.max_steps=4", "optimizer.lr=1e-3", "logging.tensorboard=false",
        "logging.plot=false", "logging.progress_bar=false",
    ]


def test_the_best_validated_checkpoint_outlives_keep_last(synthetic_cache, tmp_path):
    run_dir = tmp_path / "run"
    assert run_training(load_config(CONFIG, _overrides(synthetic_cache, run_dir))) == 0
    rows = {row["step"]: row for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    accuracy = {step: rows[step]["val/accuracy"] for step in (1, 2, 3, 4)}
    best_step = max(accuracy, key=lambda step: (accuracy[step], -step))  # the first of the highest
    chosen = [step for step in accuracy if "checkpoint/best_step" in rows[step]]
    assert chosen[0] == 1 and chosen[-1] == best_step
    assert all(accuracy[later] > accuracy[earlier] for earlier, later in zip(chosen, chosen[1:]))
    root = run_dir / "checkpoints"
    assert sorted(path.name for path in root.glob("step_*")) == sorted({f"step_{best_step:06d}", "step_000004"})
    note = json.loads((root / "BEST").read_text())
    assert note == {"step": best_step, "path": f"step_{best_step:06d}", "metric": "val/accuracy",
                    "value": accuracy[best_step]}


def test_keep_best_needs_a_validation_at_every_checkpoint(tmp_path):
    overrides = _overrides(tmp_path, tmp_path / "run")
    with pytest.raises(ConfigError, match="multiple of eval.every"):
        load_config(CONFIG, [*overrides, "eval.every=2", "checkpoint.every=3"])
    with pytest.raises(ConfigError, match="validation metric"):
        load_config(CONFIG, [*overrides, "checkpoint.keep_best=train/reward_mean"])
    assert load_config(CONFIG, [*overrides, "eval.every=2", "checkpoint.every=4"]).checkpoint.keep_best == "val/accuracy"
