"""The FLOP formula (planning/flops.py, Megatron-LM's) against torch's own count (torch.utils.flop_counter, an
independent reference) of the matmuls a tiny Megatron GPTModel runs in a forward + backward, and of the core
attention's matmuls written out (torch does not count the CPU SDPA kernel)."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_armor.models.gpt import build_gpt_model
from megatron_armor.models.hf_config import load_model_shape, transformer_config
from megatron_armor.planning.flops import forward_backward_flops, forward_flops, rl_step_flops
from megatron_armor.scoring.logprobs import token_logprobs


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama", "qwen3_moe", "qwen2_moe", "deepseek_v3"])
def test_formula_counts_the_model_s_flops(megatron_world, tiny_model_factory, arch):
    shape = load_model_shape(tiny_model_factory(arch, num_layers=3, vocab_size=256))
    model = build_gpt_model(shape, transformer_config(shape), trainable=True)
    b, s = 3, 20
    tokens = torch.randint(1, 96, (b, s), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        logprobs = token_logprobs(model(tokens, torch.arange(s).expand_as(tokens), None), tokens)
        logprobs.sum().backward()
    counts = dict(counter.get_flop_counts()["Global"])
    # torch does not count the CPU SDPA kernel, but with query and value dims that differ (multi-latent attention) it
    # takes the math path, whose batched matmuls score all s x s pairs: twice the causal half the formula counts
    scores = 2 * forward_backward_flops(shape, 0, b * s * s) if shape.mla else 0
    assert counts.pop(torch.ops.aten.bmm, 0) == scores
    assert set(counts) == {torch.ops.aten.mm}  # every projection and the LM head
    assert counts[torch.ops.aten.mm] == forward_backward_flops(shape, b * s, 0)


def test_core_attention_term_is_the_causal_half_of_the_score_matmuls(tiny_model_factory):
    shape = load_model_shape(tiny_model_factory("qwen3", num_layers=2))
    b, s, heads, d = 2, 12, shape.num_attention_heads, shape.head_dim
    q, k, v = (torch.randn(b, heads, s, d, requires_grad=True) for _ in range(3))
    with FlopCounterMode(display=False) as counter:  # one layer's QK^T and (QK^T)V, full s x s, forward + backward
        torch.softmax(q @ k.transpose(-1, -2), dim=-1).matmul(v).sum().backward()
    full_scores = counter.get_total_flops() * shape.num_layers
    assert forward_backward_flops(shape, 0, b * s * s) == full_scores / 2


def test_rl_step_adds_the_forward_only_passes(tiny_model_factory):
    shape = load_model_shape(tiny_model_factory("qwen2"))
    lengths = [5, 9, 17]
    squares = sum(n * n for n in lengths)
    update, forward = forward_backward_flops(shape, 31, squares), forward_flops(shape, 31, squares)
    assert forward * 3 == pytest.approx(update)
    armor = rl_step_flops(shape, lengths, reference=True)
    assert (armor.update, armor.old_logprobs, armor.reference, armor.teacher) == (update, forward, forward, 0.0)
    assert rl_step_flops(shape, lengths, reference=False, teacher=shape).total == pytest.approx(update + 2 * forward)
