"""Activation recomputation (recompute.granularity) leaves the gradients as they are: full (uniform and block) and
selective recomputation of a tiny Megatron model give the gradients of a run that keeps every activation."""

import pytest
import torch
from megatron.core import tensor_parallel

from megatron_armor.convert.weights import load_hf_weights
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed
from megatron_armor.models.gpt import build_gpt_model
from megatron_armor.config import RecomputeConfig
from megatron_armor.models.hf_config import load_model_shape, transformer_config


@pytest.fixture(scope="module")
def megatron_world():
    initialize_distributed(1, 1, 1)
    yield
    destroy_distributed()


def _gradients(checkpoint, recompute: RecomputeConfig) -> dict[str, torch.Tensor]:
    shape = load_model_shape(checkpoint)
    model = build_gpt_model(shape, transformer_config(shape, recompute=recompute), trainable=True)
    load_hf_weights(model, checkpoint, shape)
    tokens = torch.randint(1, shape.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))  # [b, S]
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    logits = model(tokens, positions, attention_mask=None)  # [b, S, V]
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("recompute", [
    RecomputeConfig("full", "uniform", 1), RecomputeConfig("full", "block", 1),
    RecomputeConfig("selective"),
], ids=["full-uniform", "full-block", "selective"])
def test_recomputation_gives_the_same_gradients(megatron_world, tiny_model_factory, monkeypatch, recompute):
    checkpoint = tiny_model_factory()
    kept = _gradients(checkpoint, RecomputeConfig())
    checkpointed = []  # Megatron's activation checkpoint, entered by the recomputed parts' forward
    original = tensor_parallel.checkpoint
    monkeypatch.setattr(tensor_parallel, "checkpoint", lambda *args: checkpointed.append(1) or original(*args))
    recomputed = _gradients(checkpoint, recompute)
    assert checkpointed
    assert kept.keys() == recomputed.keys()
    for name, grad in kept.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=0, atol=0, msg=name)
