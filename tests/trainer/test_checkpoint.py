"""Checkpoint layout, atomicity, the asynchronous save, refusal of other formats and the guard against
overwriting existing runs (1 process; Megatron distributed checkpointing over a 1-rank gloo group)."""

import json
import random

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from megatron_armor.config import CheckpointConfig
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed
from megatron_armor.trainer.checkpointing.best_checkpoint import BEST_FILE, BestCheckpoint
from megatron_armor.trainer.checkpointing.checkpoint import (
    CheckpointExistsError, CheckpointFormatError, checkpoint_root, guard_run_dir, latest_checkpoint, list_checkpoints,
    load_checkpoint, saved_modules,
)
from megatron_armor.trainer.checkpointing.checkpoint_save import CheckpointSaver, save_checkpoint
from megatron_armor.trainer.checkpointing.sharded_state import check_layout_change


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    initialize_distributed(1, 1, 1)
    yield
    destroy_distributed()


def _state(weight, moment, **entries):
    """A trainer state (`RLTrainer.sharded_state_dict` layout) of two sharded modules and JSON-able `entries`."""
    return {**entries, "modules": {
        "actor": {"weight": ShardedTensor.from_rank_offsets("weight", weight, replica_id=0)},
        "optimizer": {"megatron": {"exp_avg": ShardedTensor.from_rank_offsets("optimizer.state.exp_avg.weight", moment,
                                                                              replica_id=0), "lr": 0.5},
                      "counter": ShardedObject("optimizer.counter", 7, (1,), (0,), replica_id=0)},
    }}


def _request():
    """What a fresh trainer asks a load for: its own tensors (to be filled) and its own non-sharded values."""
    return _state(torch.zeros(2, 3), torch.zeros(2, 3))


def test_save_load_round_trip_restores_modules_rng_and_entries(tmp_path):
    weight, moment = torch.randn(2, 3), torch.randn(2, 3)
    torch.manual_seed(42)
    random.seed(7)
    path = save_checkpoint(tmp_path, 3, _state(weight, moment, optimizer_steps=6, sampler={"epoch": 1, "cursor": 5}))
    expected_draw = (torch.rand(3), random.random())
    torch.manual_seed(0)
    assert saved_modules(path) == ["actor", "optimizer"]
    step, state = load_checkpoint(path, _request(), seed=0)
    assert step == 3 and state.keys() == {"optimizer_steps", "sampler", "modules"}
    assert state["optimizer_steps"] == 6 and state["sampler"] == {"epoch": 1, "cursor": 5}
    assert torch.equal(state["modules"]["actor"]["weight"], weight)
    assert torch.equal(state["modules"]["optimizer"]["megatron"]["exp_avg"], moment)
    assert state["modules"]["optimizer"]["megatron"]["lr"] == 0.5 and state["modules"]["optimizer"]["counter"] == 7
    assert torch.equal(torch.rand(3), expected_draw[0]) and random.random() == expected_draw[1]


def test_on_disk_layout(tmp_path):
    """trainer_state.json: format, step, layout, module names, the sampler and every other entry under "extra";
    state/: Megatron's distributed checkpoint, one shard file per writing rank."""
    path = save_checkpoint(tmp_path, 2, _state(torch.ones(2, 3), torch.ones(2, 3), optimizer_steps=4,
                                               sampler={"epoch": 0, "cursor": 8}, mipu_gate={"rollbacks": 1}))
    assert json.loads((path / "trainer_state.json").read_text()) == {
        "format_version": 2, "step": 2, "layout": {"tp": 1, "pp": 1, "dp": 1}, "modules": ["actor", "optimizer"],
        "sampler": {"epoch": 0, "cursor": 8}, "extra": {"optimizer_steps": 4, "mipu_gate": {"rollbacks": 1}},
    }
    assert [p.name for p in (path / "state").glob("*.distcp")] == ["__0_0.distcp"]
    assert (path / "COMPLETE").is_file() and not list(checkpoint_root(tmp_path).glob(".tmp_*"))


def test_async_save_writes_the_state_at_save_time_and_completes_on_finalize(tmp_path):
    weight = torch.full((2, 3), 1.0)
    saver = CheckpointSaver(tmp_path, async_save=True)
    final = saver.save(1, _state(weight, weight.clone()))
    weight.add_(5.0)  # training goes on changing the live tensors while the shards are written
    assert not final.exists() and latest_checkpoint(checkpoint_root(tmp_path)) is None
    saver.finalize()
    assert (final / "COMPLETE").is_file()
    _, state = load_checkpoint(final, _request(), seed=0)
    assert torch.equal(state["modules"]["actor"]["weight"], torch.full((2, 3), 1.0))
    saver.save(2, _state(weight, weight))  # the next save finalizes the one in flight first
    saver.save(3, _state(weight, weight))
    assert [s for s, _ in list_checkpoints(checkpoint_root(tmp_path))] == [1, 2]
    saver.finalize()
    assert [s for s, _ in list_checkpoints(checkpoint_root(tmp_path))] == [1, 2, 3]


def test_old_and_damaged_checkpoints_are_refused(tmp_path):
    old = checkpoint_root(tmp_path) / "step_000001"
    old.mkdir(parents=True)
    torch.save({"actor": {}}, old / "rank_00000.pt")
    (old / "trainer_state.json").write_text(json.dumps({"step": 1, "extra": {}}))
    (old / "COMPLETE").write_text("1")
    with pytest.raises(CheckpointFormatError, match="rank_XXXXX.pt, format 1.*format 2"):
        load_checkpoint(old, _request(), seed=0)
    damaged = save_checkpoint(tmp_path, 2, _state(torch.ones(2, 3), torch.ones(2, 3)))
    (damaged / "trainer_state.json").write_text("{")
    with pytest.raises(CheckpointFormatError, match="unreadable trainer_state.json"):
        saved_modules(damaged)


def test_incomplete_checkpoint_is_ignored_and_keep_last_prunes(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, _state(torch.ones(2, 3), torch.ones(2, 3)), keep_last=2)
    (checkpoint_root(tmp_path) / "step_000009").mkdir()  # a crashed save: no COMPLETE marker
    assert [s for s, _ in list_checkpoints(checkpoint_root(tmp_path))] == [2, 3]
    assert latest_checkpoint(checkpoint_root(tmp_path)).name == "step_000003"


def test_the_best_checkpoint_is_kept_beside_the_newest_and_named_in_best(tmp_path):
    """checkpoint.keep_best val/accuracy with keep_last 1: the best of the validated checkpoints survives pruning,
    checkpoints/BEST names it, and the choice rides in the checkpoints so a resumed run keeps it."""
    best = BestCheckpoint(CheckpointConfig(keep_best="val/accuracy"))
    saver = CheckpointSaver(tmp_path, keep_last=1, best=best)
    for step, accuracy in ((1, 0.5), (2, 0.7), (3, 0.6), (4, float("nan")), (5, 0.65)):
        metrics = {"val/accuracy": accuracy}
        if best.improved_by(metrics):
            best.choose(step, metrics)
            assert metrics == {"val/accuracy": accuracy, "checkpoint/best_step": step, "checkpoint/best_value": accuracy}
        saver.save(step, _state(torch.ones(2, 3), torch.ones(2, 3), **best.state()))
    root = checkpoint_root(tmp_path)
    assert [s for s, _ in list_checkpoints(root)] == [2, 5]  # the best (0.7 at step 2) and the newest
    assert json.loads((root / BEST_FILE).read_text()) == {"step": 2, "path": "step_000002", "metric": "val/accuracy",
                                                          "value": 0.7}
    resumed = BestCheckpoint(CheckpointConfig(keep_best="val/accuracy"))
    resumed.load(load_checkpoint(latest_checkpoint(root), _request(), seed=0)[1])
    assert (resumed.step, resumed.value) == (2, 0.7)
    assert not resumed.improved_by({"val/accuracy": 0.69}) and resumed.improved_by({"val/accuracy": 0.71})
    lowest = BestCheckpoint(CheckpointConfig(keep_best="val/loss", best_mode="min"), step=1, value=0.3)
    assert lowest.improved_by({"val/loss": 0.2}) and not lowest.improved_by({"val/loss": 0.4})
    assert not lowest.improved_by({"train/reward_mean": 0.0})  # a step without the validation metric


def test_guard_refuses_to_overwrite_and_resume_returns_latest(tmp_path):
    assert guard_run_dir(tmp_path, resume=False, overwrite=False) is None
    save_checkpoint(tmp_path, 4, _state(torch.ones(2, 3), torch.ones(2, 3)))
    with pytest.raises(CheckpointExistsError, match="--resume.*--overwrite"):
        guard_run_dir(tmp_path, resume=False, overwrite=False)
    assert (checkpoint_root(tmp_path) / "step_000004" / "COMPLETE").is_file()
    assert guard_run_dir(tmp_path, resume=True, overwrite=False).name == "step_000004"
    assert guard_run_dir(tmp_path, resume=False, overwrite=True) is None
    assert list_checkpoints(checkpoint_root(tmp_path)) == []


def test_layout_bound_state_refuses_a_tp_or_pp_change():
    """The subspace constraint's state is per (PP, TP) position: a DP change is fine, a TP change is refused."""
    names, saved = ["actor", "optimizer", "subspace"], {"tp": 2, "pp": 1, "dp": 1}
    check_layout_change(names, saved, {"tp": 2, "pp": 1, "dp": 2})
    check_layout_change(["actor", "optimizer", "ref"], saved, {"tp": 1, "pp": 2, "dp": 1})
    with pytest.raises(ValueError, match="\\['subspace'\\] state resumes only at .* \\(tp 2 x pp 1\\)"):
        check_layout_change(names, saved, {"tp": 1, "pp": 1, "dp": 2})


@pytest.mark.parametrize("saved_master", [False, True], ids=["fp32-to-bf16", "bf16-to-fp32"])
def test_a_precision_change_of_the_optimizer_is_refused_with_what_to_do(tmp_path, saved_master):
    """A bf16 model's optimizer state holds fp32 master weights ("optimizer.state.fp32_param.<key>"), an fp32 model's
    none: a checkpoint of one does not resume the other's optimizer, and the error says which dtype to resume with."""
    def state(with_master):
        tree = _state(torch.zeros(2, 3), torch.zeros(2, 3))
        if with_master:
            tree["modules"]["optimizer"]["megatron"]["main"] = ShardedTensor.from_rank_offsets(
                "optimizer.state.fp32_param.weight", torch.zeros(2, 3), replica_id=0)
        return tree

    path = save_checkpoint(tmp_path, 1, state(saved_master))
    saved_dtype = "bfloat16" if saved_master else "float32"
    with pytest.raises(ValueError, match=f"saved with model.params_dtype {saved_dtype}.*Resume with model.params_dtype "
                                         f"{saved_dtype}, or start a new run"):
        load_checkpoint(path, state(not saved_master), seed=0)
    step, _ = load_checkpoint(path, state(saved_master), seed=0)
    assert step == 1
