"""RL-step pieces without processes: the warmup schedule, dealing groups to data-parallel ranks, a step whose
partial batch is empty, and the MIPU snapshot of the subspace constraint."""

from types import SimpleNamespace

import pytest
import torch

from megatron_armor.algorithms import ACTOR, REFERENCE
from megatron_armor.data.datasets import PromptRow, PromptSampler
from megatron_armor.data.types import Sample
from megatron_armor.diagnostics.subspace import SubspaceConstraint
from megatron_armor.config import (
    AlgorithmConfig, AnchorsConfig, MicroBatchingConfig, OptimizerConfig, RolloutConfig, TrainConfig,
)
from megatron_armor.trainer.rollouts.rollout_phase import RolloutSources, trim_to_data_parallel
from megatron_armor.trainer.rollouts.samples import SampleScorer
from megatron_armor.trainer.step.loop import RLTrainer
from megatron_armor.trainer.step_inputs.plan import StepPlan
from megatron_armor.trainer.step_inputs.policies import Policy, PolicyHandles
from megatron_armor.trainer.update.optimizer import learning_rate
from megatron_armor.trainer.update.snapshot import TrainingSnapshot
from megatron_armor.trainer.update.training_batch import local_mini_batch_groups
from megatron_armor.scoring.micro_batches import MicroBatching

from algorithm_factory import make_algorithm


def test_warmup_counts_rl_steps():
    """armor.md §6: 10 linear-warmup steps are RL steps (verl steps its scheduler once per update_actor):
    RL step k uses lr * min(1, (k + 1) / 10) for all of its mini-batches."""
    settings = OptimizerConfig(lr=1e-6, warmup_steps=10)
    expected = [1e-7 * (k + 1) for k in range(10)] + [1e-6] * 5
    assert [learning_rate(k, settings) for k in range(15)] == pytest.approx(expected, rel=1e-12)
    assert learning_rate(0, OptimizerConfig(lr=1e-6, warmup_steps=0)) == 1e-6


@pytest.mark.parametrize("dp_size, mini_batch_size", [(1, 4), (2, 4), (4, 8), (4, 4)])
def test_every_rank_gets_the_same_number_of_non_empty_mini_batches(dp_size, mini_batch_size):
    for num_groups in range(0, 3 * mini_batch_size + 2):
        kept = len(trim_to_data_parallel([[]] * num_groups, dp_size))
        assert kept == num_groups // dp_size * dp_size
        tokens = [10 + (7 * gi) % 13 for gi in range(kept)]
        shares = [local_mini_batch_groups(tokens, mini_batch_size, dp_size, rank) for rank in range(dp_size)]
        assert len({len(s) for s in shares}) == 1 and all(mini for s in shares for mini in s)
        assert sorted(gi for s in shares for mini in s for gi in mini) == list(range(kept))
        for mini in zip(*shares):  # each mini-batch: every rank the same number of groups, all from it
            assert len({len(share) for share in mini}) == 1
            assert len({gi // mini_batch_size for share in mini for gi in share}) == 1
    with pytest.raises(ValueError, match="cannot be dealt evenly"):
        local_mini_batch_groups([1, 2, 3], 4, 2, 0)


def test_groups_are_dealt_to_data_parallel_ranks_balancing_their_tokens():
    """A long tail of group lengths: dealing by index leaves one rank most of the tokens, the balanced deal
    keeps every rank within the longest group of the mean (and is never worse than by index)."""
    import random

    rng = random.Random(0)
    for trial in range(20):
        tokens = [int(200 * rng.paretovariate(1.1)) for _ in range(32)]
        dp_size = 4
        by_index = [sum(tokens[gi] for gi in range(32) if gi % dp_size == rank) for rank in range(dp_size)]
        balanced = [sum(tokens[gi] for mini in local_mini_batch_groups(tokens, 32, dp_size, rank) for gi in mini)
                    for rank in range(dp_size)]
        assert sum(balanced) == sum(tokens)
        assert max(balanced) <= max(by_index)
        assert max(balanced) - min(balanced) <= max(tokens)


def _sample(prompt_index, correct, is_anchor=False):
    return Sample(prompt_index, [1, 2], [3, 4], [-0.5, -0.5], "stop", is_anchor, 1.0 if correct else -1.0, correct)


def test_a_partial_batch_left_empty_skips_the_update_on_every_rank():
    """allow_partial_batch: 1 kept prompt on 2 data-parallel ranks is cut to 0 (one rank would have no
    batch and skip optimizer steps the other runs); the step then trains on nothing, says so, and
    touches neither the actor nor the engine."""
    plan = StepPlan(make_algorithm("grpo"), TrainConfig(train_batch_size=4, mini_batch_size=2, seed=0),
                    RolloutConfig(anchors=AnchorsConfig(ref_n=0)),
                    AlgorithmConfig(max_num_gen_batches=1, allow_partial_batch=True),
                    MicroBatching(MicroBatchingConfig(2)), actor_n=2)
    handles = PolicyHandles(actor=Policy(ACTOR, None, SimpleNamespace(metrics=dict)), ref=Policy(REFERENCE, None),
                            optimizer=None, shape=None, pad_token_id=0)
    prompts = PromptSampler([PromptRow(i, [1, 2], {}) for i in range(2)], 2, seed=0, shuffle=False)
    trainer = RLTrainer(SimpleNamespace(dp_size=2, dp_rank=1), handles, plan,
                        RolloutSources(prompts, sampling=None, scorer=SampleScorer(None, None)), scoring=None, optim=None)
    # prompt 0 is kept (one of two correct), prompt 1 is dropped (all wrong)
    trainer.rollouts.phase.sample_on_policy = lambda rows, seed, counters: [_sample(0, True), _sample(0, False),
                                                                     _sample(1, False), _sample(1, False)]
    metrics = trainer.step(0)
    assert metrics["train/update_skipped"] == 1.0 and metrics["filter/prompts_kept"] == 0.0
    assert trainer.optimizer_steps == 0 and not any(k.startswith(("loss/", "optim/")) for k in metrics)


def test_rollback_snapshot_restores_the_subspace_constraint_counters():
    model = torch.nn.Linear(3, 4, bias=False)
    actor = SimpleNamespace(module=model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    constraint = SubspaceConstraint({"w": model.weight}, {"w": model.weight.detach().clone()}, k=1)
    with torch.no_grad():
        model.weight.add_(torch.randn(4, 3))
    constraint.capture(1)
    snapshot = TrainingSnapshot.capture(actor, optimizer, 7, constraint)
    model(torch.randn(2, 3)).sum().backward()
    constraint.pre_step()  # a projected step of the candidate update
    optimizer.step()
    assert constraint.projected_steps == 1
    snapshot.restore(actor, optimizer, constraint)
    assert constraint.projected_steps == 0 and constraint.captured_step == 1
    assert torch.equal(model.weight, snapshot.params[0])
