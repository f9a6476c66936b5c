"""`RLTrainer.state_dict` / `load_state_dict` without processes: everything a resumed run needs round-trips, and
the reference is restored only when the state holds it. (Through a checkpoint on disk, which needs Megatron
modules: tests/trainer/test_end_to_end.py and test_resharded_resume.py.)"""

import json
from types import SimpleNamespace

import pytest
import torch

from megatron_armor.config import (
    AlgorithmConfig, AnchorsConfig, MicroBatchingConfig, MipuConfig, RolloutConfig, TrainConfig,
)
from megatron_armor.data.datasets import PromptRow, PromptSampler
from megatron_armor.data.types import Sample
from megatron_armor.diagnostics.subspace import SubspaceConstraint
from megatron_armor.trainer.rollouts.anchor_cache import AnchorCache
from megatron_armor.trainer.rollouts.rollout_phase import RolloutSources
from megatron_armor.trainer.step.loop import RLTrainer, TrainerParts
from megatron_armor.trainer.step_inputs.plan import StepPlan
from megatron_armor.trainer.step_inputs.policies import Policy, PolicyHandles
from megatron_armor.trainer.update.update_gate import InferenceGapGate
from megatron_armor.scoring.micro_batches import MicroBatching

from algorithm_factory import make_algorithm
from state_trees import bit_identical

ROWS = [PromptRow(i, [1, i + 2], {}) for i in range(8)]


class _Wrapped(torch.nn.Module):
    """Stands in for Megatron's DDP wrapper: the model is its `module`."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


def _trainer(seed: int, *, ref_reset_period: int = 0) -> RLTrainer:
    """A trainer of tiny models (initialised from `seed`) with every stateful part: gate, anchor cache and
    subspace constraint; the samplers' seeds are the config's, the same for every trainer."""
    torch.manual_seed(seed)
    actor = _Wrapped(torch.nn.Linear(3, 4, bias=False))
    optimizer = torch.optim.AdamW(actor.parameters(), lr=0.1)
    handles = PolicyHandles(actor=Policy("actor", actor), ref=Policy("ref", torch.nn.Linear(3, 4, bias=False)),
                            optimizer=optimizer, shape=None, pad_token_id=0)
    plan = StepPlan(make_algorithm("armor"), TrainConfig(train_batch_size=2, mini_batch_size=2, seed=0),
                    RolloutConfig(anchors=AnchorsConfig(ref_n=1)),
                    AlgorithmConfig(max_num_gen_batches=1, ref_reset_period=ref_reset_period),
                    MicroBatching(MicroBatchingConfig(2)), actor_n=2)
    weight = actor.module.weight
    constraint = SubspaceConstraint({"w": weight}, {"w": weight.detach().clone()}, k=1)
    gate_config = MipuConfig(c_start=4e-3, c_end=1e-3, ramp_steps=100, gate_prompts=2, gate_n=8)
    gate = InferenceGapGate(gate_config, ROWS, scorer=None, sampling=None, seed=0, adv_eps=1e-6)  # held-out sampler seed 1
    parts = TrainerParts(gate=gate, constraint=constraint, constraint_capture_step=1, anchor_cache=AnchorCache(AnchorsConfig(cache=True, cache_max_prompts=4)))
    return RLTrainer(SimpleNamespace(dp_size=1, dp_rank=0), handles, plan,
                     RolloutSources(PromptSampler(ROWS, 2, seed=0), sampling=None, scorer=None), scoring=None,
                     optim=None, parts=parts)


def _advance(trainer: RLTrainer) -> None:
    """Move every part of the trainer's state away from a fresh trainer's, as a few RL steps would."""
    actor = trainer.models.actor.module
    actor(torch.randn(2, 3)).sum().backward()
    trainer.models.optimizer.step()
    trainer.constraint.capture(1)
    trainer.optimizer_steps = 5
    trainer.consecutive_skips = 1
    trainer.sampler.next_batch()
    trainer.sampler.next_batch()
    trainer.gate.prompts.next_batch()
    trainer.gate.rollbacks = 2
    anchor = Sample(0, [1, 2], [3], [-0.5], "stop", True, 1.0, True)
    trainer.anchors.cache.fetch(ROWS[:1], lambda missing: [anchor])


def test_state_dict_holds_every_part_and_round_trips():
    source = _trainer(0)
    _advance(source)
    state = source.state_dict()
    assert state.keys() == {"optimizer_steps", "consecutive_skips", "sampler", "mipu_gate", "anchor_cache", "modules"}
    assert state["modules"].keys() == {"actor", "optimizer", "subspace"}  # the reference is model.ref_path's
    json.dumps({k: v for k, v in state.items() if k != "modules"})  # the shared part is JSON-able
    fresh = _trainer(1)
    assert not bit_identical(fresh.state_dict(), state)
    fresh.load_state_dict(state)
    assert bit_identical(fresh.state_dict(), state)
    assert fresh.optimizer_steps == 5 and fresh.consecutive_skips == 1
    assert fresh.gate.rollbacks == 2 and len(fresh.anchors.cache) == 1
    assert fresh.sampler.next_batch() == source.sampler.next_batch()


def test_reference_is_restored_only_when_the_state_holds_it():
    """The reference is checkpointed only once it leaves model.ref_path (reference resets); a resume restores it
    whenever the state holds it (whatever the current config says) and leaves it alone otherwise."""
    resetting = _trainer(0, ref_reset_period=2)
    with_ref = resetting.state_dict()
    assert "ref" in with_ref["modules"]
    without_ref = _trainer(0).state_dict()

    fresh = _trainer(1, ref_reset_period=2)
    ref_before = fresh.models.ref.model.weight.clone()
    fresh.load_state_dict(without_ref)
    assert torch.equal(fresh.models.ref.model.weight, ref_before)

    fresh = _trainer(1)
    fresh.load_state_dict(with_ref)
    assert torch.equal(fresh.models.ref.model.weight, resetting.models.ref.model.weight)
    assert "ref" in fresh.state_dict()["modules"]  # restored from a checkpoint: checkpointed from then on


def test_a_state_without_a_required_module_is_refused():
    state = _trainer(0).state_dict()
    del state["modules"]["subspace"]
    with pytest.raises(ValueError, match="no \\['subspace'\\] state"):
        _trainer(1).load_state_dict(state)
