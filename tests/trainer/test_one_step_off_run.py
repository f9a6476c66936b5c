"""rollout.mode one_step_off and async through `armor train` (TP=2, 2 gloo ranks; the background rollouts gather samples over a
group of their own while the update's collectives run on the default group).

At learning rate 0 the weights never change, so one_step_off must train on exactly sync's batches (same prompts,
samples and rewards) with sync's losses (up to the behaviour weight pi_old / mu, which is 1 but for the engine's
last-bit differences). With lr > 0 the samples of step t+1 come from the weights before step t's update: staleness 1
and importance weights away from 1. A run of either mode resumed from a checkpoint taken with a rollout generated
ahead regenerates it from the same prompts: at lr 0 it trains the uninterrupted run's batches."""

import json
import shutil
from pathlib import Path

import pytest
from launcher import run_workers

CONFIG = str(Path(__file__).parents[2] / "examples" / "tiny" / "armor.yaml")
STEPS = 2
BATCH = ("train/reward_mean", "train/accuracy", "response/length_mean", "filter/prompts_kept", "armor/anchors_used",
         "train/num_gen_batches")
LOSSES = ("loss/policy_loss", "loss/clip_fraction", "policy/entropy", "optim/grad_norm")


def _run(cache: Path, tmp_path: Path, name: str, *overrides: str) -> list[dict]:
    """The metrics rows of a `train.max_steps=STEPS` run in `tmp_path / name` (an override "--resume" resumes it from
    its latest checkpoint)."""
    run_dir = tmp_path / name
    run_workers("train_run.py", 2, tmp_path / f"w-{name}", CONFIG, f"task.cache_dir={cache}",
                f"logging.run_dir={run_dir}", f"train.max_steps={STEPS}", "task.num_train_rows=400",
                "task.num_val_rows=16", "eval.every=0", "eval.before_train=false", "checkpoint.every=1",
                "checkpoint.keep_last=0",
                "checkpoint.save_model=false", "logging.tensorboard=false", "logging.plot=false", *overrides)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _sampler(run_dir: Path, step: int) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step_{step:06d}" / "trainer_state.json").read_text())["sampler"]


def _resumed_after_step_1(cache: Path, tmp_path: Path, source: str, name: str, *overrides: str) -> list[dict]:
    """Run `name` resumed from step 1's checkpoint of run `source` (with its metrics up to there: what a run stopped
    after step 1 leaves); its metrics rows, after it trained the other steps and checkpointed each."""
    shutil.copytree(tmp_path / source / "checkpoints" / "step_000001", tmp_path / name / "checkpoints" / "step_000001")
    first_row = (tmp_path / source / "metrics.jsonl").read_text().splitlines(keepends=True)[0]
    (tmp_path / name / "metrics.jsonl").write_text(first_row)
    return _run(cache, tmp_path, name, "--resume", *overrides)


def _same_training(resumed: dict, uninterrupted: dict) -> None:
    """A resumed run's step trained the uninterrupted run's batch (prompts, samples, rewards) with its losses (at lr 0:
    all but the overlap figures and the staleness, which regenerated rollouts do not have, are the same)."""
    same = [key for key in uninterrupted if not key.startswith(("perf/", "async/staleness_"))]
    assert {key: resumed[key] for key in same} == {key: uninterrupted[key] for key in same}, uninterrupted["step"]


def test_one_step_off_trains_sync_s_batches_at_lr_0_and_lags_one_version_at_lr_above_0(synthetic_cache, tmp_path):
    sync = _run(synthetic_cache, tmp_path, "sync", "optimizer.lr=0")
    off = _run(synthetic_cache, tmp_path, "off", "optimizer.lr=0", "rollout.mode=one_step_off")
    for a, b in zip(sync, off, strict=True):
        assert {k: a[k] for k in BATCH} == {k: b[k] for k in BATCH}, a["step"]
        assert {k: b[k] for k in LOSSES} == pytest.approx({k: a[k] for k in LOSSES}, rel=1e-4, abs=1e-6), a["step"]
        assert not any(key.startswith("async/") for key in a) and "perf/overlap_fraction" not in a
        assert b["async/importance_weight_mean"] == pytest.approx(1.0, abs=1e-4) and b["async/clipped_fraction"] == 0
    assert [row["async/staleness_max"] for row in off] == [0.0, 1.0]
    assert all(0 <= row["perf/overlap_fraction"] <= 1 and row["perf/trainer_idle_seconds"] >= 0 for row in off)
    # a checkpoint saves the sampler from before the rollout generated ahead: sync's position at the same step
    for step in range(1, STEPS + 1):
        assert _sampler(tmp_path / "off", step) == _sampler(tmp_path / "sync", step), step
    # ... so a run resumed there generates step 2's rollout again, from the same prompts: it trains off's step 2
    resumed = _resumed_after_step_1(synthetic_cache, tmp_path, "off", "off-resumed", "optimizer.lr=0",
                                    "rollout.mode=one_step_off")
    assert [row["step"] for row in resumed] == [1, 2] and resumed[1]["async/staleness_max"] == 0.0  # regenerated
    _same_training(resumed[1], off[1])
    assert _sampler(tmp_path / "off-resumed", 2) == _sampler(tmp_path / "off", 2)

    lagging = _run(synthetic_cache, tmp_path, "lagging", "optimizer.lr=5e-3", "rollout.mode=one_step_off")
    assert [row["async/staleness_mean"] for row in lagging] == [0.0, 1.0]
    first, later = lagging[0], lagging[1:]
    assert first["async/importance_weight_mean"] == pytest.approx(1.0, abs=1e-4)  # generated by the same weights
    # sampled a step back: the trainer's pi_old is not the sampler's mu (k3 = E[r - 1 - log r] >= 0 for every token,
    # so unlike the mean importance weight it cannot average out to its on-policy value)
    assert all(row["mismatch/logprob_abs_diff"] > 10 * first["mismatch/logprob_abs_diff"] for row in later)
    assert all(row["mismatch/k3"] > 1e-4 > abs(first["mismatch/k3"]) for row in later)


def test_async_trains_on_no_sample_older_than_max_staleness(synthetic_cache, tmp_path):
    """rollout.mode async at lr > 0 with max_staleness 0: the generator (TP=2 collectives on its own group) runs ahead
    during the update, and whatever it sampled from the weights before the update is dropped, not trained."""
    rows = _run(synthetic_cache, tmp_path, "async", "optimizer.lr=5e-3", "rollout.mode=async", "rollout.max_staleness=0",
                "rollout.async_buffer_batches=2")
    assert [row["async/staleness_max"] for row in rows] == [0.0] * STEPS
    assert all(row["async/dropped_stale_groups"] >= 0 and 0 <= row["perf/overlap_fraction"] <= 1 for row in rows)
    # every trained sample came from the trainer's current weights: the engine's logprobs are the trainer's
    assert all(row["mismatch/logprob_abs_diff"] < 1e-5 for row in rows)
    assert all(row["filter/prompts_kept"] > 0 for row in rows)


def test_async_resumed_from_a_checkpoint_trains_the_uninterrupted_run_s_prompts_and_samples(synthetic_cache, tmp_path):
    """rollout.mode async at lr 0, where the weights never change and a generation batch's seeds derive from the
    sampler position it starts at. Step 1's checkpoint is taken with a batch generated ahead in the buffer (the
    uninterrupted run trains it at step 2, one version old), which it does not save: the run resumed from it
    regenerates that batch from the same prompts and trains step 2 exactly as the uninterrupted run did. Every
    checkpoint's sampler position is gen_batch_size x the generation batches consumed so far: no prompt is trained
    twice or skipped."""
    overrides = ("optimizer.lr=0", "rollout.mode=async", f"rollout.max_staleness={STEPS}")  # no batch dropped as stale
    full = _run(synthetic_cache, tmp_path, "async-full", *overrides)
    assert [row["async/staleness_max"] for row in full] == [0.0, 1.0]  # step 2 trained a batch generated ahead
    assert all(row["async/dropped_stale_groups"] == 0 for row in full)
    gen_batch = 16  # examples/tiny/armor.yaml's train.gen_batch_size
    drawn = [gen_batch * int(sum(row["train/num_gen_batches"] for row in full[:step])) for step in range(1, STEPS + 1)]
    assert [_sampler(tmp_path / "async-full", step) for step in range(1, STEPS + 1)] == [
        {"epoch": 0, "cursor": cursor} for cursor in drawn]

    resumed = _resumed_after_step_1(synthetic_cache, tmp_path, "async-full", "async-resumed", *overrides)
    assert [row["step"] for row in resumed] == [1, 2] and resumed[1]["async/staleness_max"] == 0.0  # regenerated
    _same_training(resumed[1], full[1])
    assert _sampler(tmp_path / "async-resumed", 2) == _sampler(tmp_path / "async-full", 2)
