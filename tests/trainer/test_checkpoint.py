"""Checkpoint layout, atomicity and the guard against overwriting existing runs (1 process)."""

import random

import pytest
import torch

from megatron_armor.trainer.checkpoint import (
    CheckpointExistsError, TrainerState, checkpoint_root, guard_run_dir, latest_checkpoint, list_checkpoints,
    load_checkpoint, save_checkpoint,
)


def _modules(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return {"actor": model, "optimizer": opt}


def test_save_load_round_trip_restores_weights_optimizer_rng_and_state(tmp_path):
    saved = _modules(0)
    state = TrainerState(step=3, sampler={"epoch": 1, "cursor": 5}, extra={"optimizer_steps": 6})
    torch.manual_seed(42)
    random.seed(7)
    path = save_checkpoint(tmp_path, 3, saved, state)
    expected_draw = (torch.rand(3), random.random())
    restored = _modules(1)
    assert not torch.equal(restored["actor"].weight, saved["actor"].weight)
    torch.manual_seed(0)
    loaded_state, optional = load_checkpoint(path, restored)
    assert loaded_state == state and optional == set()
    assert torch.equal(restored["actor"].weight, saved["actor"].weight)
    exp_avg = lambda o: next(iter(o.state_dict()["state"].values()))["exp_avg"]  # noqa: E731
    assert torch.equal(exp_avg(restored["optimizer"]), exp_avg(saved["optimizer"]))
    assert torch.equal(torch.rand(3), expected_draw[0]) and random.random() == expected_draw[1]


def test_optional_modules_are_restored_only_when_the_checkpoint_holds_them(tmp_path):
    """The reference is checkpointed only once it leaves model.ref_path; a resume restores it whenever the
    checkpoint holds it (whatever the current config says) and leaves it alone otherwise."""
    saved, ref = _modules(0), torch.nn.Linear(3, 2)
    with_ref = save_checkpoint(tmp_path / "a", 1, {**saved, "ref": ref}, TrainerState(1, {}, {}))
    without_ref = save_checkpoint(tmp_path / "b", 1, saved, TrainerState(1, {}, {}))
    fresh = torch.nn.Linear(3, 2)
    _, restored = load_checkpoint(without_ref, _modules(1), optional={"ref": fresh})
    assert restored == set() and not torch.equal(fresh.weight, ref.weight)
    _, restored = load_checkpoint(with_ref, _modules(1), optional={"ref": fresh})
    assert restored == {"ref"} and torch.equal(fresh.weight, ref.weight)


def test_incomplete_checkpoint_is_ignored_and_keep_last_prunes(tmp_path):
    modules = _modules(0)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, modules, TrainerState(step, {}, {}), keep_last=2)
    (checkpoint_root(tmp_path) / "step_000009").mkdir()  # a crashed save: no COMPLETE marker
    assert [s for s, _ in list_checkpoints(checkpoint_root(tmp_path))] == [2, 3]
    assert latest_checkpoint(checkpoint_root(tmp_path)).name == "step_000003"


def test_guard_refuses_to_overwrite_and_resume_returns_latest(tmp_path):
    assert guard_run_dir(tmp_path, resume=False, overwrite=False) is None
    save_checkpoint(tmp_path, 4, _modules(0), TrainerState(4, {}, {}))
    with pytest.raises(CheckpointExistsError, match="--resume.*--overwrite"):
        guard_run_dir(tmp_path, resume=False, overwrite=False)
    assert (checkpoint_root(tmp_path) / "step_000004" / "rank_00000.pt").is_file()
    assert guard_run_dir(tmp_path, resume=True, overwrite=False).name == "step_000004"
    assert guard_run_dir(tmp_path, resume=False, overwrite=True) is None
    assert list_checkpoints(checkpoint_root(tmp_path)) == []
