"""`sample_next_tokens`: top-p after temperature, logprobs before the top-p cut, greedy at T = 0."""

import math

import torch

from megatron_armor.rollout.base import SamplingParams
from megatron_armor.rollout.local import sample_next_tokens

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
DRAWS = 10_000


def draw(temperature, top_p, rows=DRAWS, seed=0):
    """[rows, 4] copies of log(PROBS) (+ a constant the softmax ignores) sampled with one seeded generator."""
    logits = (PROBS.log() + 3.0).repeat(rows, 1)
    sampling = SamplingParams(temperature=temperature, top_p=top_p)
    return logits, *sample_next_tokens(logits, sampling, torch.Generator().manual_seed(seed))


def test_top_p_keeps_the_smallest_head_reaching_it_and_renormalises():
    # Cumulative probabilities ahead of each token: 0, .5, .8, .95. The values avoid those ties, where
    # float rounding of the cumulative sum would decide.
    _, tokens, _ = draw(1.0, top_p=0.7)
    assert set(tokens.tolist()) == {0, 1}
    share = (tokens == 0).float().mean().item()
    sigma = math.sqrt(0.625 * 0.375 / DRAWS)
    assert abs(share - 0.5 / 0.8) < 4 * sigma, share
    _, tokens, _ = draw(1.0, top_p=0.4)
    assert set(tokens.tolist()) == {0}


def test_logprobs_are_log_softmax_of_scaled_logits_before_top_p():
    logits, tokens, logprobs = draw(0.7, top_p=0.7, rows=64)
    want = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs, want, atol=1e-6, rtol=0)
    assert logprobs.dtype == torch.float32 and logprobs.shape == tokens.shape == (64,)


def test_temperature_zero_is_argmax_with_unscaled_logprobs():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [3.0, 0.0, 0.0, 2.5]])
    tokens, logprobs = sample_next_tokens(logits, SamplingParams(temperature=0.0), None)
    assert tokens.tolist() == [1, 0]
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


def test_draws_follow_the_distribution_and_never_pick_a_token_of_probability_zero():
    """Inverse-CDF draws: each token's share matches its probability (within 4 sigma), a token with probability
    0 (exp(-inf)) between two others is never drawn, and rows drawn for a batch of which only some rows remain
    (`rows`) equal the full batch's draws of those rows."""
    _, tokens, _ = draw(1.0, top_p=1.0)
    for token, p in enumerate(PROBS.tolist()):
        share = (tokens == token).float().mean().item()
        assert abs(share - p) < 4 * math.sqrt(p * (1 - p) / DRAWS), (token, share)
    logits = torch.tensor([[0.0, -math.inf, 0.0]]).repeat(DRAWS, 1)
    tokens, _ = sample_next_tokens(logits, SamplingParams(temperature=1.0), torch.Generator().manual_seed(1))
    assert set(tokens.tolist()) == {0, 2}
    full, _ = sample_next_tokens(logits[:6], SamplingParams(temperature=1.0), torch.Generator().manual_seed(2))
    kept = torch.tensor([1, 4, 5])
    part, _ = sample_next_tokens(logits[kept], SamplingParams(temperature=1.0), torch.Generator().manual_seed(2),
                                 rows=kept, batch_size=6)
    assert part.tolist() == full[kept].tolist()
