"""Checkpoint layout, atomicity and the guard against overwriting existing runs (1 process)."""

import json
import random

import pytest
import torch

from megatron_armor.trainer.checkpoint import (
    CheckpointExistsError, checkpoint_root, guard_run_dir, latest_checkpoint, list_checkpoints, load_checkpoint,
    save_checkpoint,
)


def _modules(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return {"actor": model, "optimizer": opt}


def _state(modules, **entries):
    """A trainer state (`RLTrainer.state_dict` layout) of `modules` and the JSON-able `entries`."""
    return {**entries, "modules": {name: module.state_dict() for name, module in modules.items()}}


def test_save_load_round_trip_restores_weights_optimizer_rng_and_state(tmp_path):
    saved = _modules(0)
    torch.manual_seed(42)
    random.seed(7)
    path = save_checkpoint(tmp_path, 3, _state(saved, optimizer_steps=6, sampler={"epoch": 1, "cursor": 5}))
    expected_draw = (torch.rand(3), random.random())
    restored = _modules(1)
    assert not torch.equal(restored["actor"].weight, saved["actor"].weight)
    torch.manual_seed(0)
    step, state = load_checkpoint(path)
    assert step == 3 and state.keys() == {"optimizer_steps", "sampler", "modules"}
    assert state["optimizer_steps"] == 6 and state["sampler"] == {"epoch": 1, "cursor": 5}
    for name, module in restored.items():
        module.load_state_dict(state["modules"][name])
    assert torch.equal(restored["actor"].weight, saved["actor"].weight)
    exp_avg = lambda o: next(iter(o.state_dict()["state"].values()))["exp_avg"]  # noqa: E731
    assert torch.equal(exp_avg(restored["optimizer"]), exp_avg(saved["optimizer"]))
    assert torch.equal(torch.rand(3), expected_draw[0]) and random.random() == expected_draw[1]


def test_on_disk_layout_is_that_of_earlier_checkpoints(tmp_path):
    """Checkpoints written before the trainer had a state_dict stay resumable: the rank file holds each module's
    state and the RNG states, trainer_state.json the step, the sampler and every other entry under "extra"."""
    path = save_checkpoint(tmp_path, 2, _state(_modules(0), optimizer_steps=4, sampler={"epoch": 0, "cursor": 8},
                                               mipu_gate={"prompts": {"epoch": 0, "cursor": 2}, "rollbacks": 1}))
    assert json.loads((path / "trainer_state.json").read_text()) == {
        "step": 2, "sampler": {"epoch": 0, "cursor": 8},
        "extra": {"optimizer_steps": 4, "mipu_gate": {"prompts": {"epoch": 0, "cursor": 2}, "rollbacks": 1}},
    }
    assert set(torch.load(path / "rank_00000.pt", weights_only=False)) == {"actor", "optimizer", "rng"}
    step, state = load_checkpoint(path)
    assert step == 2 and state["mipu_gate"]["rollbacks"] == 1 and set(state["modules"]) == {"actor", "optimizer"}


def test_incomplete_checkpoint_is_ignored_and_keep_last_prunes(tmp_path):
    modules = _modules(0)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, _state(modules), keep_last=2)
    (checkpoint_root(tmp_path) / "step_000009").mkdir()  # a crashed save: no COMPLETE marker
    assert [s for s, _ in list_checkpoints(checkpoint_root(tmp_path))] == [2, 3]
    assert latest_checkpoint(checkpoint_root(tmp_path)).name == "step_000003"


def test_guard_refuses_to_overwrite_and_resume_returns_latest(tmp_path):
    assert guard_run_dir(tmp_path, resume=False, overwrite=False) is None
    save_checkpoint(tmp_path, 4, _state(_modules(0)))
    with pytest.raises(CheckpointExistsError, match="--resume.*--overwrite"):
        guard_run_dir(tmp_path, resume=False, overwrite=False)
    assert (checkpoint_root(tmp_path) / "step_000004" / "rank_00000.pt").is_file()
    assert guard_run_dir(tmp_path, resume=True, overwrite=False).name == "step_000004"
    assert guard_run_dir(tmp_path, resume=False, overwrite=True) is None
    assert list_checkpoints(checkpoint_root(tmp_path)) == []
