"""Short ARMOR runs through the whole stack with TP=2 on 2 gloo processes, and exact resume, also of a
reference that a reset moved away from model.path."""

import json
import logging
import math
import re
import shutil
from pathlib import Path

import torch

from launcher import run_workers
from state_trees import saved_modules
from megatron_armor.config import load_config
from megatron_armor.trainer.run.train import run_training

CONFIG = str(Path(__file__).parents[2] / "examples" / "tiny" / "armor.yaml")


def _read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _overrides(cache_dir: Path, run_dir: Path, steps: int) -> list[str]:
    return [
        f"task.cache_dir={cache_dir}", f"logging.run_dir={run_dir}", f"train.max_steps={steps}",
        "task.num_train_rows=400", "task.num_val_rows=16", "eval.every=2", "eval.max_prompts=8",
        "checkpoint.every=1", "checkpoint.keep_last=0", "logging.tensorboard=false",
    ]


def _ref_state(run_dir: Path, step: int) -> dict:
    return saved_modules(run_dir / "checkpoints" / f"step_{step:06d}")["ref"]


def test_armor_tp2_run_then_resume_matches_uninterrupted(synthetic_cache, tmp_path, caplog):
    """The reference is reset to the actor after step 2 (the last reset of a 3-step run). The interrupted
    run (the 3-step run's checkpoint and metrics up to step 2: what a 2-step run leaves, as the same code
    saves every checkpoint) resumes from step 2 with ref_reset_period 0, as run_8b_until_180.sh does
    (armor.md §4): it must restore the checkpoint's reference, not reload model.path, to match the
    uninterrupted run."""
    cache_dir = synthetic_cache
    full, part = tmp_path / "full", tmp_path / "part"
    run_workers("train_run.py", 2, tmp_path / "w1", CONFIG, *_overrides(cache_dir, full, 3),
                "algorithm.ref_reset_period=2")
    rows = _read_metrics(full)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[2]["armor/ref_reset"] == 1.0 and "armor/ref_reset" not in rows[3]
    assert abs(rows[3]["mix_kl/kl_on_old"]) < 1e-6  # step 3 starts with the reference equal to the actor
    for row in rows[1:]:
        for key in ("train/reward_mean", "armor/anchors_used", "filter/prompts_kept", "loss/clip_fraction",
                    "loss/mixed_ratio_mean", "policy/entropy", "mismatch/logprob_abs_diff", "perf/step_seconds",
                    "perf/tokens_per_second", "loss/policy_loss"):
            assert math.isfinite(row[key]), (key, row)
        assert row["perf/tflops_per_gpu"] > 0  # planning/flops.py's count of the step / its seconds / 2 ranks
        assert row["armor/anchors_used"] == row["filter/prompts_kept"] > 0
        assert row["mix_kl/main_ratio"] == 7 / 8  # groups of 7 on-policy samples and 1 anchor
        assert row["mismatch/logprob_abs_diff"] < 1e-3
    assert "val/accuracy" in rows[0] and "val/accuracy" in rows[2]
    assert (full / "curves.png").is_file()
    assert (full / "checkpoints" / "step_000003" / "COMPLETE").is_file()

    # Starting again over a run directory that holds checkpoints is refused and touches nothing (the
    # refusal comes first on every rank, so one in-process rank shows it).
    saved = {p: p.read_bytes() for p in (full / "checkpoints").rglob("*") if p.is_file()}
    refused = load_config(CONFIG, [*_overrides(cache_dir, full, 5), "parallel.tensor_parallel_size=1"])
    with caplog.at_level(logging.ERROR):
        assert run_training(refused) == 1
    assert re.search("already holds checkpoints.*--resume.*--overwrite", caplog.text)
    assert {p: p.read_bytes() for p in (full / "checkpoints").rglob("*") if p.is_file()} == saved
    assert len(_read_metrics(full)) == 4

    shutil.copytree(full / "checkpoints" / "step_000002", part / "checkpoints" / "step_000002")
    metrics = (full / "metrics.jsonl").read_text().splitlines(keepends=True)
    (part / "metrics.jsonl").write_text("".join(metrics[:3]))  # steps 0-2
    run_workers("train_run.py", 2, tmp_path / "w2", CONFIG, "--resume", *_overrides(cache_dir, part, 3),
                "algorithm.ref_reset_period=0")
    resumed = _read_metrics(part)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    deterministic = [k for k in rows[3] if not k.startswith("perf/")]
    assert {k: resumed[3][k] for k in deterministic} == {k: rows[3][k] for k in deterministic}
    # The frozen reference stays in later checkpoints, so resuming again keeps it too.
    saved, kept = _ref_state(part, 2), _ref_state(part, 3)
    tensors = [k for k, v in saved.items() if isinstance(v, torch.Tensor)]  # (Megatron adds layers' extra states)
    assert saved.keys() == kept.keys() and tensors and all(torch.equal(saved[k], kept[k]) for k in tensors)


def test_dp2_distributed_optimizer_resume_matches_uninterrupted(synthetic_cache, tmp_path):
    """At DP=2 the distributed optimizer is on by default; the checkpoint holds the Adam moments of every
    parameter, both ranks write shards of it, and a run resumed from step 1 at the same layout gives step 2's
    metrics exactly."""
    full, part = tmp_path / "full", tmp_path / "part"
    layout = ["parallel.tensor_parallel_size=1", "parallel.data_parallel_size=2", "eval.every=0"]
    run_workers("train_run.py", 2, tmp_path / "w1", CONFIG, *_overrides(synthetic_cache, full, 2), *layout)
    rows = _read_metrics(full)
    checkpoint = full / "checkpoints" / "step_000001"
    assert sorted(p.name for p in (checkpoint / "state").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    saved = saved_modules(checkpoint)
    assert saved["optimizer"]["adam_step"] == 2  # two mini-batches
    assert {f"optimizer.state.{moment}.{key}" for key in saved["actor"] if not key.endswith("_extra_state")
            for moment in ("exp_avg", "exp_avg_sq")} == set(saved["optimizer"]) - {"adam_step"}
    shutil.copytree(full / "checkpoints" / "step_000001", part / "checkpoints" / "step_000001")
    (part / "metrics.jsonl").write_text("".join((full / "metrics.jsonl").read_text().splitlines(keepends=True)[:2]))
    run_workers("train_run.py", 2, tmp_path / "w2", CONFIG, "--resume", *_overrides(synthetic_cache, part, 2), *layout)
    resumed = _read_metrics(part)
    deterministic = [k for k in rows[2] if not k.startswith("perf/")]
    assert {k: resumed[2][k] for k in deterministic} == {k: rows[2][k] for k in deterministic}
