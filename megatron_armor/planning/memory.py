"""Per-GPU bytes of a Megatron GPTModel's training state and activations, from its shape and layout.

Units: every `*_bytes` value is bytes on one GPU; token counts are tokens of one micro-batch on one
data-parallel rank. The accounting follows what the code keeps (checked against the tensors on CPU,
tests/planning/): Megatron DDP's grad buffers (fp32, `grad_reduce_in_fp32`), Megatron's Adam (fp32 exp_avg and
exp_avg_sq, plus fp32 master weights for a bf16 model; sharded over DP with the distributed optimizer), and the
tensors autograd saves for backward in each decoder layer of the local or Transformer Engine layer spec.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from megatron_armor.models.hf_config import ActivationRecompute, ModelShape

FP32 = 4
PARAM_ALIGN = 64  # Megatron's distributed optimizer starts every parameter at a multiple of 64 elements
BUCKET_ALIGN = 128  # ... and pads each bucket to a multiple of lcm(DP, 128) elements


@dataclass(frozen=True)
class Layout:
    """How a model is split and trained: TP x PP x DP sizes, sequence parallelism, the distributed optimizer,
    the weights' bytes per element (2 for bf16, 4 for fp32), activation recomputation, the LM head ("torch":
    [tokens, V/tp] logits; "fused": no logits) and the attention kernel (`local_attention`: the local layer spec's
    SDPAttention, which repeats K/V to every query head, as on CPU; else Transformer Engine's flash attention)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    dtype_bytes: int = 2
    recompute: ActivationRecompute = ActivationRecompute()
    head: str = "fused"
    local_attention: bool = False

    def with_(self, **changes) -> Layout:
        return replace(self, **changes)


def layer_parameter_numels(shape: ModelShape, tp: int) -> list[int]:
    """Elements of each parameter tensor of one decoder layer on one TP rank, in Megatron's order."""
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    h = shape.hidden_size
    numels = [h, h * (q + 2 * kv) // tp]  # input norm, fused QKV (column-parallel)
    numels += [(q + 2 * kv) // tp] if shape.qkv_bias else []
    numels += [shape.head_dim, shape.head_dim] if shape.qk_norm else []  # q / k norms, replicated
    numels += [q * h // tp, h, 2 * shape.ffn_hidden_size * h // tp, shape.ffn_hidden_size * h // tp]
    return numels  # ... output projection (row-parallel), pre-MLP norm, fc1 (gate + up), fc2


def stage_parameter_numels(shape: ModelShape, tp: int, pp: int, stage: int) -> list[int]:
    """Elements of each parameter tensor on a rank of pipeline stage `stage` (embedding on the first, final norm
    and output layer on the last; a tied output layer is the embedding itself when one stage holds both)."""
    embedding = shape.padded_vocab_size * shape.hidden_size // tp
    numels = [embedding] if stage == 0 else []
    numels += layer_parameter_numels(shape, tp) * (shape.num_layers // pp)
    if stage == pp - 1:
        numels.append(shape.hidden_size)  # final norm
        if not (shape.tie_word_embeddings and pp == 1):
            numels.append(embedding)
    return numels


def parameter_count(shape: ModelShape, tp: int = 1, pp: int = 1) -> int:
    """Parameters on one GPU of the largest pipeline stage."""
    return max(sum(stage_parameter_numels(shape, tp, pp, stage)) for stage in range(pp))


def grad_buffer_numel(numels: list[int], dp: int, distributed_optimizer: bool) -> int:
    """Elements of Megatron DDP's (single-bucket) grad buffer for parameters of `numels`: their sum, with the
    distributed optimizer's alignment (each parameter's start to 64 elements, in backprop order, and the end to
    lcm(DP, 128))."""
    if not distributed_optimizer:
        return sum(numels)
    end = 0
    for numel in reversed(numels):
        end = -(-end // PARAM_ALIGN) * PARAM_ALIGN + numel
    divisor = math.lcm(dp, BUCKET_ALIGN)
    return -(-end // divisor) * divisor


@dataclass(frozen=True)
class StateBytes:
    """Bytes per GPU of the model state: `weights` (dtype), `gradients` (fp32 DDP grad buffer), and Adam's state
    `optimizer` as the layout runs it, with `optimizer_replicated` / `optimizer_distributed` both variants
    (moments, plus fp32 master weights of a bf16 model; the distributed one sharded over DP)."""

    params: int
    weights: int
    gradients: int
    optimizer: int
    optimizer_replicated: int
    optimizer_distributed: int


def state_bytes(shape: ModelShape, layout: Layout) -> StateBytes:
    """The model state of the largest pipeline stage's rank (Adam's per-tensor step counters are left out)."""
    stage = max(range(layout.pp), key=lambda s: sum(stage_parameter_numels(shape, layout.tp, layout.pp, s)))
    numels = stage_parameter_numels(shape, layout.tp, layout.pp, stage)
    params = sum(numels)
    per_param = 2 * FP32 + (FP32 if layout.dtype_bytes != FP32 else 0)  # exp_avg, exp_avg_sq (+ fp32 master)
    replicated, distributed = params * per_param, math.ceil(params * per_param / layout.dp)
    return StateBytes(
        params=params, weights=params * layout.dtype_bytes,
        gradients=grad_buffer_numel(numels, layout.dp, layout.distributed_optimizer) * FP32,
        optimizer=distributed if layout.distributed_optimizer else replicated,
        optimizer_replicated=replicated, optimizer_distributed=distributed,
    )
