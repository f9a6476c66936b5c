"""Loss aggregation (algorithms/reduce.py): token mean vs per-response token mean then mean over responses."""

import pytest
import torch

from algorithm_factory import make_algorithm
from hf_reference import assert_same_grads
from megatron_armor.algorithms import armor_policy_loss, sampler_corrected_loss
from megatron_armor.algorithms.reduce import aggregate_loss, aggregation_units

VALUES = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 0.0, 0.0, 0.0], [5.0, 7.0, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])


def test_known_answers():
    # token mean: (1 + 2 + 3 + 4 + 5 + 7) / 6; per response: means 2, 4, 6 -> 4
    assert float(aggregate_loss(VALUES, MASK, "token_mean")) == pytest.approx(22 / 6)
    assert float(aggregate_loss(VALUES, MASK, "seq_mean_token_mean")) == pytest.approx(4.0)
    assert float(aggregation_units(MASK, "token_mean")) == 6 and float(aggregation_units(MASK, "seq_mean_token_mean")) == 3
    # a response without response tokens is no unit and adds nothing
    padded, padded_mask = torch.cat([VALUES, torch.ones(1, 4)]), torch.cat([MASK, torch.zeros(1, 4)])
    assert float(aggregate_loss(padded, padded_mask, "seq_mean_token_mean")) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="unknown loss aggregation 'sum'"):
        aggregate_loss(VALUES, MASK, "sum")


def test_config_default_is_per_algorithm_and_overridable():
    assert make_algorithm("mipu").loss_aggregation == "seq_mean_token_mean"
    assert make_algorithm("grpo").loss_aggregation == "token_mean"
    assert make_algorithm("mipu", "algorithm.loss_aggregation=token_mean").loss_aggregation == "token_mean"


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_partial_sums_over_global_units_equal_the_whole_batch(aggregation):
    """What the trainer does under micro-batching / DP: sum the micro-batches' partial sums, divide by all units."""
    whole = aggregate_loss(VALUES, MASK, aggregation)
    parts = [(VALUES[i : i + 1], MASK[i : i + 1]) for i in range(3)]
    partial = sum(aggregate_loss(v, m, aggregation, normalizer=1.0) for v, m in parts)
    units = sum(aggregation_units(m, aggregation) for _, m in parts)
    assert float(partial / units) == pytest.approx(float(whole))


def test_policy_losses_take_the_aggregation():
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(3, 4, generator=g)
    logp = (old + 0.05 * torch.randn(3, 4, generator=g)).requires_grad_()
    adv = torch.tensor([[1.0], [-1.0], [0.5]]).expand(3, 4)
    per_token = -adv * (logp - old).exp()  # no clipping at these ratios, wbar = 1
    for aggregation in ("token_mean", "seq_mean_token_mean"):
        expected = aggregate_loss(per_token, MASK, aggregation)
        armor, _ = armor_policy_loss(logp, old, None, adv, MASK, alpha=1.0, aggregation=aggregation)
        mipu, _ = sampler_corrected_loss(logp, old, old, adv, MASK, correction="none", aggregation=aggregation)
        torch.testing.assert_close(armor, expected)
        torch.testing.assert_close(mipu, expected)
    token, _ = armor_policy_loss(logp, old, None, adv, MASK, alpha=1.0)
    assert token.item() != pytest.approx(expected.item())  # the two modes weigh responses differently here


# ----- the trainer's MIPU loss through Megatron: micro-batching and data parallelism ---------------------------
def test_mipu_loss_is_exact_under_micro_batching_and_data_parallelism(mipu_case, loss_workers):
    """Two data-parallel ranks (3 and 2 responses), micro-batches of 1 or all: the gradients and loss
    metrics equal the single-process per-response reference of each aggregation (conftest.py `mipu_case`)."""
    _, _, reference = mipu_case
    token, seq = reference["token_mean"]["grads"], reference["seq_mean_token_mean"]["grads"]
    assert any(not torch.allclose(token[n], seq[n], rtol=1e-2) for n in token)  # the modes differ on this batch
    for rank, results in enumerate(loss_workers):
        for aggregation, expected in reference.items():
            for micro in ("one", "whole"):
                result = results[f"{aggregation}/{micro}"]
                assert_same_grads(result["grads"], expected["grads"])
                for name in ("policy_loss", "kl_to_ref"):
                    assert result["metrics"][f"loss/{name}"] == pytest.approx(expected[name], rel=1e-5), (rank, micro)
