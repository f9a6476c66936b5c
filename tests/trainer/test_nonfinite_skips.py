"""Non-finite updates through `armor train`'s code path (`run_training`): a step whose second mini-batch has
NaN advantages is skipped with nothing of it left in the actor or the optimizer, the next step trains, and on
two data-parallel ranks one rank's NaN skips the step on both; train.max_consecutive_skips bad steps in a row
stop the run with a checkpoint it resumes from."""

import json
import logging
from pathlib import Path

import pytest
import torch

from algorithm_factory import NanAdvantagesOnChosenSteps
from launcher import run_workers
from state_trees import bit_identical, saved_modules
from megatron_armor.algorithms import register_algorithm, unregister_algorithm
from megatron_armor.config import load_config
from megatron_armor.trainer.run.train import run_training

CONFIG = str(Path(__file__).parents[2] / "examples" / "tiny" / "armor.yaml")


@pytest.fixture
def nan_algorithm(monkeypatch):
    register_algorithm(NanAdvantagesOnChosenSteps)
    yield lambda steps: monkeypatch.setattr(NanAdvantagesOnChosenSteps, "bad_steps", frozenset(steps))
    unregister_algorithm(NanAdvantagesOnChosenSteps.name)


def _overrides(cache: Path, run_dir: Path, *overrides: str) -> list[str]:
    return [
        "algorithm.name=test_nan_advantages", "rollout.sampling.actor_n=8", "parallel.tensor_parallel_size=1",
        f"task.cache_dir={cache}", f"logging.run_dir={run_dir}", "task.num_train_rows=400", "task.num_val_rows=16",
        "eval.every=0", "eval.before_train=false", "checkpoint.save_model=false", "checkpoint.keep_last=0",
        "logging.tensorboard=false", "logging.plot=false", "logging.progress_bar=false", *overrides,
    ]


def _config(cache: Path, run_dir: Path, *overrides: str):
    return load_config(CONFIG, _overrides(cache, run_dir, *overrides))


def _checkpoint(run_dir: Path, step: int) -> tuple[dict, dict]:
    """(the saved modules, every rank's shards together; trainer_state.json's "extra") of checkpoint `step`."""
    path = run_dir / "checkpoints" / f"step_{step:06d}"
    return saved_modules(path), json.loads((path / "trainer_state.json").read_text())["extra"]


def _metrics(run_dir: Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_a_nonfinite_step_is_skipped_whole_and_the_next_one_trains(synthetic_cache, tmp_path, nan_algorithm, caplog):
    nan_algorithm({1})
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="megatron_armor"):
        assert run_training(_config(synthetic_cache, run_dir, "train.max_steps=3", "checkpoint.every=1")) == 0
    rows = _metrics(run_dir)
    assert rows[2]["train/update_skipped"] == 1 and rows[2]["train/nonfinite_skipped"] == 1
    assert rows[2]["train/nonfinite_kept_mini_batches"] == 0
    for good in (1, 3):
        assert rows[good]["train/update_skipped"] == 0 and "train/nonfinite_skipped" not in rows[good]
        assert rows[good]["optim/grad_norm"] > 0
    assert "RL step 2, mini-batch 1: non-finite loss on rank(s) [0], non-finite gradients (or gradient norm) on rank(s) [0]" in caplog.text
    (before, _), (after, skipped), (trained, next_state) = (_checkpoint(run_dir, step) for step in (1, 2, 3))
    # mini-batch 0 of step 2 was stepped, then undone: weights, Adam moments and step counts as after step 1
    assert bit_identical(after["actor"], before["actor"]) and bit_identical(after["optimizer"], before["optimizer"])
    assert skipped["optimizer_steps"] == 2 and skipped["consecutive_skips"] == 1
    assert not bit_identical(trained["actor"], after["actor"])
    assert next_state["optimizer_steps"] == 4 and next_state["consecutive_skips"] == 0


def test_without_rollback_the_mini_batches_before_the_nonfinite_one_stay_applied(synthetic_cache, tmp_path,
                                                                                 nan_algorithm):
    nan_algorithm({1})
    run_dir = tmp_path / "run"
    config = _config(synthetic_cache, run_dir, "train.max_steps=2", "checkpoint.every=1", "train.nonfinite_rollback=false")
    assert run_training(config) == 0
    row = _metrics(run_dir)[2]
    assert row["train/update_skipped"] == 1 and row["train/nonfinite_kept_mini_batches"] == 1
    (before, _), (after, state) = (_checkpoint(run_dir, step) for step in (1, 2))
    assert not bit_identical(after["actor"], before["actor"])  # mini-batch 0 of step 2 was stepped and kept
    assert state["optimizer_steps"] == 3 and state["consecutive_skips"] == 1


def test_consecutive_skips_stop_the_run_with_a_checkpoint_it_resumes_from(synthetic_cache, tmp_path, nan_algorithm,
                                                                         caplog):
    """One mini-batch per step (no snapshot is taken: its only mini-batch is checked before it is stepped)."""
    nan_algorithm({0, 1})
    run_dir = tmp_path / "run"
    overrides = ("train.max_steps=3", "train.max_consecutive_skips=2", "checkpoint.every=100",
                 "train.mini_batch_size=8")
    with caplog.at_level(logging.WARNING, logger="megatron_armor"):
        assert run_training(_config(synthetic_cache, run_dir, *overrides)) == 1
    assert "RL step 2, mini-batch 0: non-finite loss" in caplog.text
    assert "TooManySkipsError: RL steps 1..2 (2 in a row) skipped their update" in caplog.text
    assert "train.max_consecutive_skips=2" in caplog.text and "step_000002" in caplog.text
    modules, state = _checkpoint(run_dir, 2)
    assert state["optimizer_steps"] == 0 and state["consecutive_skips"] == 2
    moments = [value for key, value in modules["optimizer"].items() if key != "adam_step"]
    assert modules["optimizer"]["adam_step"] == 0 and moments  # no Adam step of a skipped mini-batch survived
    assert all(not moment.any() for moment in moments)

    nan_algorithm(())
    assert run_training(_config(synthetic_cache, run_dir, *overrides), resume=True) == 0
    assert _metrics(run_dir)[3]["train/update_skipped"] == 0
    _, resumed = _checkpoint(run_dir, 3)
    assert resumed["optimizer_steps"] == 1 and resumed["consecutive_skips"] == 0


def test_one_ranks_nonfinite_loss_skips_the_step_on_every_rank(synthetic_cache, tmp_path):
    """Data-parallel size 2, NaN advantages on rank 1 only: both ranks skip step 2 and keep step 1's state; the
    warning names rank 1 for the loss and both ranks for the gradients (the data-parallel all-reduce spread it).
    The same run audits its samples (reward.audit_fns) on both ranks: an audit equal to the training verifier
    agrees with train/accuracy, one that calls everything wrong flags every sample the verifier calls correct,
    which holds only when the two ranks' counts are summed."""
    never = tmp_path / "never.py"
    never.write_text("def wrong(response, row):\n    return 0.0, False\n")
    run_dir = tmp_path / "run"
    run_workers("train_run.py", 2, tmp_path / "out", CONFIG, *_overrides(
        synthetic_cache, run_dir, "algorithm.name=algorithm_factory:NanOnRankOneAtStepTwo",
        "parallel.data_parallel_size=2", "train.max_steps=2", "checkpoint.every=1",
        f"reward.audit_fns=megatron_armor.rewards.arithmetic:verify,{never}:wrong",
    ))
    rows = _metrics(run_dir)
    assert rows[1]["train/update_skipped"] == 0 and rows[2]["train/nonfinite_skipped"] == 1
    for row in rows.values():
        assert 0 < row["train/accuracy"] < 1
        assert row["audit/arithmetic_verify_accuracy"] == row["train/accuracy"]
        assert row["audit/arithmetic_verify_hack_rate"] == 0 and row["audit/never_wrong_accuracy"] == 0
        assert row["audit/never_wrong_hack_rate"] == row["train/accuracy"] == row["audit/hack_rate"]
    logs = (tmp_path / "out" / "stderr.txt").read_text()
    assert "RL step 2, mini-batch 1: non-finite loss on rank(s) [1], non-finite gradients (or gradient norm) on rank(s) [0, 1]" in logs
    (before, _), (after, _) = (_checkpoint(run_dir, step) for step in (1, 2))  # both ranks' shards
    assert bit_identical(after["actor"], before["actor"]) and bit_identical(after["optimizer"], before["optimizer"])


def test_finite_gradients_whose_norm_overflows_fp32_count_as_nonfinite():
    """Megatron clips by the fp32 norm: finite gradients of norm above sqrt(fp32 max) ~ 1.8e19 would clip by an
    infinite norm (a step with zeroed gradients), so the mini-batch is skipped like a NaN one."""
    from types import SimpleNamespace

    from megatron_armor.trainer.update.faults import _grads_finite

    def ddp(*buffers):
        return SimpleNamespace(buffers=[SimpleNamespace(grad_data=b) for b in buffers], expert_parallel_buffers=[])

    assert _grads_finite(ddp(torch.full((4,), 9e18), torch.zeros(3)))  # norm 1.8e19: norm^2 3.24e38 < 3.40e38
    assert not _grads_finite(ddp(torch.full((4,), 1e19), torch.zeros(3)))  # norm^2 4e38 overflows
    assert not _grads_finite(ddp(torch.full((2,), 1e19), torch.full((2,), -1e19)))  # the sum over buffers does too
    assert not _grads_finite(ddp(torch.tensor([1.0, float("nan")])))
    assert _grads_finite(ddp(torch.zeros(5))) and _grads_finite(ddp())
