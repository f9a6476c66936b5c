"""The planner's bytes against the tensors of tiny Megatron models (one process; TP=2 / DP=2 in
test_memory_distributed.py): parameters, DDP grad buffers and Adam state exactly, and the activations autograd saves
for backward within 15% (counted with saved_tensors_hooks, saved_bytes.py), for every recomputation setting."""

import pytest
import torch
from saved_bytes import estimated_saved_bytes, measured_saved_bytes

from megatron_armor.models.gpt import build_gpt_model
from megatron_armor.config import OptimizerConfig, RecomputeConfig
from megatron_armor.models.hf_config import load_model_shape, transformer_config
from megatron_armor.planning.memory import Layout, state_bytes
from megatron_armor.trainer.update.optimizer import optimizer_step, wrap_for_training

RECOMPUTE = [RecomputeConfig(), RecomputeConfig("selective"), RecomputeConfig("full", "uniform", 1),
             RecomputeConfig("full", "uniform", 2), RecomputeConfig("full", "block", 2)]
RECOMPUTE_IDS = ["none", "selective", "full-uniform-1", "full-uniform-2", "full-block-2"]


def adam_state_bytes(optimizer) -> int:
    """Bytes of Adam's moment tensors (per-parameter step counters, 0-dim, left out as the planner does)."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return sum(value.nbytes for part in parts for state in part.optimizer.state.values()
               for value in state.values() if torch.is_tensor(value) and value.dim())


@pytest.mark.parametrize("arch,tied", [("qwen2", False), ("qwen3", False), ("llama", True)])
def test_state_bytes_equal_the_tensors(megatron_world, tiny_model_factory, arch, tied):
    shape = load_model_shape(tiny_model_factory(arch, num_layers=3, tie_word_embeddings=tied))
    ddp, optimizer = wrap_for_training(build_gpt_model(shape, transformer_config(shape), trainable=True), OptimizerConfig())
    tokens = torch.randint(1, 96, (2, 8))
    ddp(tokens, torch.arange(8).expand_as(tokens), None).sum().backward()
    optimizer_step(ddp, optimizer, lr=1e-3)  # Adam's moments exist after the first step
    planned = state_bytes(shape, Layout(dtype_bytes=4))
    params = list(ddp.module.parameters())
    assert planned.params == sum(p.numel() for p in params)
    assert planned.weights == sum(p.nbytes for p in params)
    assert planned.gradients == sum(buffer.grad_data.nbytes for buffer in ddp.buffers)
    assert planned.optimizer == adam_state_bytes(optimizer) == planned.optimizer_replicated


@pytest.mark.parametrize("head", ["torch", "fused"])
@pytest.mark.parametrize("recompute", RECOMPUTE, ids=RECOMPUTE_IDS)
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3_moe", "qwen2_moe"])
def test_activation_estimate_within_15_percent(megatron_world, tiny_model_factory, arch, recompute, head):
    shape = load_model_shape(tiny_model_factory(arch, num_layers=4, vocab_size=256))
    model = build_gpt_model(shape, transformer_config(shape, recompute=recompute), trainable=True)
    b, s = 2, 40
    tokens = torch.randint(1, 96, (b, s), generator=torch.Generator().manual_seed(1))
    measured = measured_saved_bytes(model, tokens, head)
    layout = Layout(dtype_bytes=4, recompute=recompute, head=head, local_attention=True)
    assert estimated_saved_bytes(shape, layout, b * s) == pytest.approx(measured, rel=0.15)
