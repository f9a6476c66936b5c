"""The planner's bytes against the tensors of tiny Megatron models (one process; TP=2 / DP=2 in
test_memory_distributed.py): parameters, DDP grad buffers and Adam state exactly (a bf16 model's weights, grad buffers, fp32 master weights and
moments each, with and without the distributed optimizer), and the activations autograd saves
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
    optimizer = getattr(optimizer, "megatron_optimizer", optimizer)  # a ShardedStateOptimizer's Megatron optimizer
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return sum(value.nbytes for part in parts for state in part.optimizer.state.values()
               for value in state.values() if torch.is_tensor(value) and value.dim())


@pytest.mark.parametrize("arch,tied", [("qwen2", False), ("qwen3", False), ("llama", True)])
def test_state_bytes_equal_the_tensors(megatron_world, tiny_model_factory, arch, tied):
    shape = load_model_shape(tiny_model_factory(arch, num_layers=3, tie_word_embeddings=tied))
    ddp, optimizer = wrap_for_training(OptimizerConfig(), model=build_gpt_model(shape, transformer_config(shape), trainable=True))
    tokens = torch.randint(1, 96, (2, 8))
    ddp(tokens, torch.arange(8).expand_as(tokens), None).sum().backward()
    optimizer_step(ddp, optimizer, lr=1e-3)  # Adam's moments exist after the first step
    planned = state_bytes(shape, Layout(dtype_bytes=4))
    params = list(ddp.module.parameters())
    assert planned.params == sum(p.numel() for p in params)
    assert planned.weights == sum(p.nbytes for p in params)
    assert planned.gradients == sum(buffer.grad_data.nbytes for buffer in ddp.buffers)
    assert planned.optimizer == adam_state_bytes(optimizer) == planned.optimizer_replicated
    assert planned.master_weights == master_weight_bytes(optimizer) == 0  # fp32: the weights are the masters


def master_weight_bytes(optimizer) -> int:
    """Bytes of the fp32 master weights Megatron's mixed-precision optimizer keeps for bf16 parameters (all of them
    for the plain one, this rank's slices for the distributed one; none for an fp32 model)."""
    megatron = getattr(optimizer, "megatron_optimizer", optimizer)
    parts = getattr(megatron, "chained_optimizers", [megatron])
    groups = [getattr(part, "fp32_from_float16_groups", None) or getattr(part, "shard_fp32_from_float16_groups", [])
              for part in parts]
    return sum(main.nbytes for part in groups for group in part for main in group)


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_bf16_state_bytes_equal_the_tensors(megatron_world, tiny_model_factory, arch, distributed):
    """A bf16 model trained through Megatron's mixed-precision optimizer: bf16 weights, fp32 grad buffers (with the
    distributed optimizer's padding), fp32 master weights and Adam's fp32 moments, each term against the tensors."""
    shape = load_model_shape(tiny_model_factory(arch, num_layers=2))
    config = transformer_config(shape, params_dtype=torch.bfloat16)
    model = build_gpt_model(shape, config, trainable=True).to(dtype=torch.bfloat16)
    ddp, optimizer = wrap_for_training(OptimizerConfig(), model=model, distributed=distributed)
    tokens = torch.randint(1, 96, (2, 8))
    ddp(tokens, torch.arange(8).expand_as(tokens), None).float().sum().backward()
    optimizer_step(ddp, optimizer, lr=1e-3)
    planned = state_bytes(shape, Layout(dtype_bytes=2, distributed_optimizer=distributed))
    params = list(ddp.module.parameters())
    assert {p.dtype for p in params} == {torch.bfloat16}
    assert planned.weights == sum(p.nbytes for p in params) == 2 * planned.params
    assert planned.gradients == sum(buffer.grad_data.nbytes for buffer in ddp.buffers)
    assert planned.master_weights == master_weight_bytes(optimizer) == 4 * planned.params
    assert planned.optimizer == adam_state_bytes(optimizer) + master_weight_bytes(optimizer)
    assert planned.optimizer - planned.master_weights == adam_state_bytes(optimizer) == 8 * planned.params


def test_lora_state_bytes_by_hand():
    """Rank-4 adapters on the tiny Qwen2 shape (hidden 64, 4 heads of 16, 2 KV groups: QKV out 128; FFN 176; 2
    layers) at TP 1, then TP 2 (the column layers' B and the row layers' A halve)."""
    from megatron_armor.config import LoRAConfig
    from megatron_armor.models.hf_config import ModelShape

    shape = ModelShape(arch="qwen2", hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                       ffn_hidden_size=176, vocab_size=128, max_position_embeddings=256, rope_theta=1e4,
                       norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=True, head_dim=16)
    lora = LoRAConfig(rank=4)
    # per layer: proj A 4x64, B 64x4; qkv A 4x64, B 128x4; fc1 A 4x64, B 352x4; fc2 A 4x176, B 64x4
    per_layer = 256 + 256 + 256 + 512 + 256 + 1408 + 704 + 256
    full = state_bytes(shape, Layout(dtype_bytes=2))
    planned = state_bytes(shape, Layout(dtype_bytes=2, lora=lora))
    assert planned.trainable == 2 * per_layer and planned.params == full.params + 2 * per_layer
    assert planned.weights == 2 * planned.params
    assert planned.gradients == 4 * 2 * per_layer  # fp32 grad buffer of the adapters only
    assert planned.optimizer == (8 + 4) * 2 * per_layer  # Adam moments + fp32 masters of the adapters only
    tp2 = 256 // 2 + 256 + 256 + 512 // 2 + 256 + 1408 // 2 + 704 // 2 + 256
    assert state_bytes(shape, Layout(tp=2, dtype_bytes=2, lora=lora)).trainable == 2 * tp2


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_lora_state_bytes_equal_the_tensors(megatron_world, tiny_model_factory, arch, distributed):
    """A bf16 LoRA model (a MoE model's experts adapted too): the weights are the base's and the adapters', the grad
    buffers, master weights and Adam moments the adapters' only, each term against the tensors."""
    from megatron_armor.config import LoRAConfig
    from megatron_armor.models.lora import apply_lora

    shape = load_model_shape(tiny_model_factory(arch, num_layers=2))
    lora = LoRAConfig(rank=4, experts=arch == "qwen3_moe")
    model = build_gpt_model(shape, transformer_config(shape, params_dtype=torch.bfloat16), trainable=True)
    model = model.to(dtype=torch.bfloat16)
    apply_lora(model, lora)
    ddp, optimizer = wrap_for_training(OptimizerConfig(), model=model, distributed=distributed)
    tokens = torch.randint(1, 96, (2, 8))
    ddp(tokens, torch.arange(8).expand_as(tokens), None).float().sum().backward()
    optimizer_step(ddp, optimizer, lr=1e-3)
    planned = state_bytes(shape, Layout(dtype_bytes=2, distributed_optimizer=distributed, lora=lora))
    params = list(ddp.module.parameters())
    trainable = [p for p in params if p.requires_grad]
    assert planned.params == sum(p.numel() for p in params) and planned.trainable == sum(p.numel() for p in trainable)
    assert planned.weights == sum(p.nbytes for p in params)
    assert planned.gradients == sum(buffer.grad_data.nbytes for buffer in ddp.buffers + ddp.expert_parallel_buffers)
    assert planned.master_weights == master_weight_bytes(optimizer) == 4 * planned.trainable
    assert planned.optimizer - planned.master_weights == adam_state_bytes(optimizer) == 8 * planned.trainable


@pytest.mark.parametrize("head", ["torch", "fused"])
@pytest.mark.parametrize("recompute", RECOMPUTE, ids=RECOMPUTE_IDS)
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "deepseek_v3"])
def test_activation_estimate_within_15_percent(megatron_world, tiny_model_factory, arch, recompute, head):
    shape = load_model_shape(tiny_model_factory(arch, num_layers=4, vocab_size=256))
    model = build_gpt_model(shape, transformer_config(shape, recompute=recompute), trainable=True)
    b, s = 2, 40
    tokens = torch.randint(1, 96, (b, s), generator=torch.Generator().manual_seed(1))
    measured = measured_saved_bytes(model, tokens, head)
    layout = Layout(dtype_bytes=4, recompute=recompute, head=head, local_attention=True)
    assert estimated_saved_bytes(shape, layout, b * s) == pytest.approx(measured, rel=0.15)
