"""The on-policy fast path (issue 18): with one mini-batch per RL step the update's own forward gives the old-policy
logprobs and entropy, and the step's loss, gradients and weights equal the two-pass path's (a separate old-policy
pass, then the update) on a real Megatron actor, DDP and optimizer in one process."""

import pytest
import torch

from megatron_armor.convert.loading import load_gpt_model
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed
from megatron_armor.config import (
    AlgorithmConfig, AnchorsConfig, MicroBatchingConfig, OptimizerConfig, RolloutConfig, TrainConfig,
)
from megatron_armor.models.hf_config import load_model_shape
from megatron_armor.scoring.logprobs import ScoringConfig, compute_logprobs
from megatron_armor.scoring.micro_batches import MicroBatching
from megatron_armor.trainer.step_inputs.plan import StepPlan
from megatron_armor.trainer.update.optimizer import wrap_for_training
from megatron_armor.trainer.update.policy_update import update_policy

from algorithm_factory import make_algorithm
from sequence_batches import batch_of

OPTIM = OptimizerConfig(lr=1e-3, warmup_steps=0)
SCORING = ScoringConfig()
BATCHING = MicroBatching(MicroBatchingConfig(micro_batch_size=3))


def _batch():
    """Seven rows of mixed lengths with reference logprobs (MIPU's KL term reads them)."""
    batch = batch_of([6, 21, 9, 17, 4, 25, 12])
    noise = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(5))
    batch.ref_logprobs = (-2.0 + 0.1 * noise) * batch.response_mask
    return batch


@pytest.fixture
def checkpoint(tiny_model_factory):
    initialize_distributed(1, 1, 1)
    yield tiny_model_factory("qwen2")
    destroy_distributed()


def _step(checkpoint, algorithm, *, two_pass: bool):
    """(update result, old-policy scores, weights after the step) of one update from the checkpoint's weights."""
    ddp, optimizer = wrap_for_training(OPTIM, model=load_gpt_model(checkpoint, load_model_shape(checkpoint), trainable=True))
    batch = _batch()
    separate = None
    if two_pass:
        separate = compute_logprobs(ddp, batch, micro_batching=BATCHING, scoring=ScoringConfig(with_entropy=True))
        batch.old_logprobs = separate.logprobs
    result = update_policy(ddp, optimizer, [batch], micro_batching=BATCHING, algorithm=algorithm, scoring=SCORING,
                           optim=OPTIM, rl_step=0)
    weights = {name: p.detach().clone() for name, p in ddp.module.named_parameters()}
    return result, separate if two_pass else result.old_scores, weights


@pytest.mark.parametrize("algorithm", ["grpo", "mipu"])
def test_the_update_scores_the_old_policy_itself_and_steps_as_the_two_pass_path(checkpoint, algorithm):
    algorithm = make_algorithm(algorithm)
    fast, fast_scores, fast_weights = _step(checkpoint, algorithm, two_pass=False)
    slow, slow_scores, slow_weights = _step(checkpoint, algorithm, two_pass=True)
    assert slow.old_scores is None and fast.old_scores is not None
    torch.testing.assert_close(fast_scores.logprobs, slow_scores.logprobs, atol=1e-6, rtol=0)
    torch.testing.assert_close(fast_scores.entropy, slow_scores.entropy, atol=1e-6, rtol=0)
    assert fast_scores.logprobs.abs().sum() > 0
    assert fast.metrics.keys() == slow.metrics.keys()
    for name, value in slow.metrics.items():
        assert fast.metrics[name] == pytest.approx(value, rel=1e-6, abs=1e-9), name
    assert fast.metrics["optim/grad_norm"] > 0
    for name, weight in slow_weights.items():
        torch.testing.assert_close(fast_weights[name], weight, atol=1e-7, rtol=0, msg=name)


def test_the_fast_path_is_taken_only_with_one_mini_batch_and_an_algorithm_that_allows_it(checkpoint):
    def plan(algorithm, mini_batch_size):
        train = TrainConfig(train_batch_size=8, mini_batch_size=mini_batch_size, seed=0)
        return StepPlan(make_algorithm(algorithm), train, RolloutConfig(anchors=AnchorsConfig(ref_n=0)),
                        AlgorithmConfig(max_num_gen_batches=1), BATCHING, actor_n=2)

    assert plan("grpo", 8).old_logprobs_from_update and plan("armor", 8).old_logprobs_from_update
    assert not plan("grpo", 4).old_logprobs_from_update  # the second mini-batch runs after an optimizer step
    assert not plan("opd", 8).old_logprobs_from_update  # its token advantages read them before the update
    ddp, optimizer = wrap_for_training(OPTIM, model=load_gpt_model(checkpoint, load_model_shape(checkpoint), trainable=True))
    batch = _batch()
    with pytest.raises(ValueError, match="one mini-batch per RL step"):
        update_policy(ddp, optimizer, [batch.select(slice(0, 3)), batch.select(slice(3, 7))], micro_batching=BATCHING,
                      algorithm=make_algorithm("grpo"), scoring=SCORING, optim=OPTIM, rl_step=0)
