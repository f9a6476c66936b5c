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

from megatron_armor.config import LoRAConfig, RecomputeConfig, expert_tp_size
from megatron_armor.models.families import model_family
from megatron_armor.models.hf_config import ModelShape

FP32 = 4
PARAM_ALIGN = 64  # Megatron's distributed optimizer starts every parameter at a multiple of 64 elements
BUCKET_ALIGN = 128  # ... and pads each bucket to a multiple of lcm(DP, 128) elements


@dataclass(frozen=True)
class Layout:
    """How a model is split and trained: TP x PP x CP x DP sizes (a MoE model's experts over `ep` ranks, each expert's
    matrices over `etp` ranks, None: TP, Megatron's default expert TP; each sequence over `cp` context-parallel
    ranks, which hold the same weights and state), sequence parallelism, the distributed optimizer,
    the weights' bytes per element (2 for bf16, 4 for fp32), activation recomputation, the LM head ("torch":
    [tokens, V/tp] logits; "fused": no logits) and the attention kernel (`local_attention`: the local layer spec's
    SDPAttention, which repeats K/V to every query head, as on CPU; else Transformer Engine's flash attention).
    `lora`: model.lora; with adapters only they train (the base is frozen: no gradients, no optimizer state)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    dtype_bytes: int = 2
    recompute: RecomputeConfig = RecomputeConfig()
    head: str = "fused"
    local_attention: bool = False
    lora: LoRAConfig = LoRAConfig()

    def with_(self, **changes) -> Layout:
        return replace(self, **changes)

    @property
    def expert_tp(self) -> int:
        """Ranks each expert's matrices are split over (`etp`, or TP when unset)."""
        return expert_tp_size(self.tp, self.etp)

    @property
    def dp_cp(self) -> int:
        """Ranks holding the same (dense) weights: Megatron's data-parallel group with context parallelism, over
        which DDP reduces gradients and the distributed optimizer shards its state."""
        return self.dp * self.cp

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same experts (Megatron's expert data-parallel group): each pipeline stage's tp x cp x dp
        ranks regrouped as expert TP x EP x expert DP (`config.check_expert_layout`); dp x cp / ep at expert TP = TP."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)


def layer_parameter_numels(shape: ModelShape, tp: int, layer: int = 0) -> list[int]:
    """Elements of each parameter tensor of decoder layer `layer` on one TP rank, in Megatron's order, its experts
    left out (`layer_expert_numels`)."""
    h = shape.hidden_size
    numels = attention_numels(shape, tp) + [h]  # the pre-MLP norm
    if shape.is_moe_layer(layer):
        shared = shape.shared_expert_ffn_hidden_size
        gate = [h] if shared and model_family(shape.arch).expert_names.shared_gate else []
        # the router (replicated; its expert bias is a buffer, not trained), then a shared expert's gate vector
        # (replicated) where it has one, fc1 (gate + up) and fc2
        return numels + [shape.num_experts * h] + (gate + [2 * shared * h // tp, shared * h // tp] if shared else [])
    return numels + [2 * shape.ffn_hidden_size * h // tp, shape.ffn_hidden_size * h // tp]  # fc1 (gate + up), fc2


def attention_numels(shape: ModelShape, tp: int) -> list[int]:
    """Elements of each parameter of a layer's attention and its input norm on one TP rank (local layer spec)."""
    h, mla = shape.hidden_size, shape.mla
    if mla is not None:  # multi-latent attention: every projection column- or row-parallel, the latents' norms whole
        heads = shape.num_attention_heads
        return [h, heads * mla.v_head_dim * h // tp, mla.q_lora_rank * h // tp,
                heads * mla.q_head_dim * mla.q_lora_rank // tp, (mla.kv_lora_rank + mla.qk_rope_head_dim) * h // tp,
                heads * (mla.qk_nope_head_dim + mla.v_head_dim) * mla.kv_lora_rank // tp, mla.q_lora_rank,
                mla.kv_lora_rank]
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    numels = [h, h * (q + 2 * kv) // tp]  # input norm, fused QKV (column-parallel)
    numels += [(q + 2 * kv) // tp] if shape.qkv_bias else []
    numels += [shape.head_dim, shape.head_dim] if shape.qk_norm else []  # q / k norms, replicated
    return numels + [q * h // tp]  # output projection (row-parallel)


def layer_expert_numels(shape: ModelShape, etp: int, ep: int, layer: int) -> list[int]:
    """Elements of each expert parameter of decoder layer `layer` on one rank: its num_experts / ep experts'
    fc1 (gate + up) and fc2, each over `etp` expert-TP ranks (none in a dense layer)."""
    if not shape.is_moe_layer(layer):
        return []
    f, h = shape.moe_ffn_hidden_size, shape.hidden_size
    return [2 * f * h // etp, f * h // etp] * (shape.num_experts // ep)


def stage_parameter_numels(
    shape: ModelShape, tp: int, pp: int, stage: int, ep: int = 1, etp: int | None = None
) -> list[int]:
    """Elements of each parameter tensor on a rank of pipeline stage `stage` (embedding on the first, final norm
    and output layer on the last; a tied output layer is the embedding itself when one stage holds both), the
    rank's experts (of `ep`, each over `etp` ranks, None: `tp`) included."""
    return stage_dense_numels(shape, tp, pp, stage) + stage_expert_numels(shape, expert_tp_size(tp, etp), pp, stage, ep)


def stage_dense_numels(shape: ModelShape, tp: int, pp: int, stage: int) -> list[int]:
    """`stage_parameter_numels` without the experts (the parameters replicated over all data-parallel ranks)."""
    embedding = shape.padded_vocab_size * shape.hidden_size // tp
    numels = [embedding] if stage == 0 else []
    for layer in _stage_layers(shape, pp, stage):
        numels += layer_parameter_numels(shape, tp, layer)
    if stage == pp - 1:
        numels.append(shape.hidden_size)  # final norm
        if not (shape.tie_word_embeddings and pp == 1):
            numels.append(embedding)
    return numels


def stage_expert_numels(shape: ModelShape, etp: int, pp: int, stage: int, ep: int = 1) -> list[int]:
    """The expert parameters of a rank of pipeline stage `stage`, its experts over `ep` ranks and each over `etp`
    (replicated over the expert data-parallel ranks only, `Layout.expert_dp`)."""
    return [numel for layer in _stage_layers(shape, pp, stage) for numel in layer_expert_numels(shape, etp, ep, layer)]


def _stage_layers(shape: ModelShape, pp: int, stage: int) -> range:
    per_stage = shape.num_layers // pp
    return range(stage * per_stage, (stage + 1) * per_stage)


def parameter_count(shape: ModelShape, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None) -> int:
    """Parameters on one GPU of the largest pipeline stage (experts over `ep` ranks, each over `etp`, None: `tp`)."""
    return max(sum(stage_parameter_numels(shape, tp, pp, stage, ep, etp)) for stage in range(pp))


def _adapter(rank: int, column: bool, in_size: int, out_size: int, tp: int) -> list[int]:
    """[A, B] elements on one TP rank of a rank-`rank` adapter on a column-parallel (A [r, in], B [out/tp, r]) or
    row-parallel (A [r, in/tp], B [out, r]) layer of `in_size` x `out_size` (`models.lora`)."""
    return [rank * in_size, out_size // tp * rank] if column else [rank * in_size // tp, out_size * rank]


def layer_adapter_numels(shape: ModelShape, lora: LoRAConfig, tp: int, layer: int) -> list[int]:
    """Elements of each adapter parameter of decoder layer `layer` on one TP rank, in Megatron's order (attention's
    output projection, then its QKV, then the MLP's fc1 and fc2: a MoE layer's shared expert's), the routed experts'
    left out (`layer_expert_adapter_numels`)."""
    q, kv, h, r = shape.num_attention_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, shape.hidden_size, lora.rank
    ffn = shape.shared_expert_ffn_hidden_size if shape.is_moe_layer(layer) else shape.ffn_hidden_size
    layers = {"linear_proj": (False, q, h), "linear_qkv": (True, h, q + 2 * kv)}
    if ffn:
        layers |= {"linear_fc1": (True, h, 2 * ffn), "linear_fc2": (False, ffn, h)}
    return [numel for name, (column, i, o) in layers.items() if name in lora.target_modules
            for numel in _adapter(r, column, i, o, tp)]


def layer_expert_adapter_numels(shape: ModelShape, lora: LoRAConfig, ep: int, layer: int) -> list[int]:
    """Elements of the routed experts' adapter parameters of decoder layer `layer` on one rank (`lora.experts`: each of
    its num_experts / ep experts' fc1 and fc2, whole: expert TP 1)."""
    if not (lora.experts and shape.is_moe_layer(layer)):
        return []
    f, h = shape.moe_ffn_hidden_size, shape.hidden_size
    layers = {"linear_fc1": (True, h, 2 * f), "linear_fc2": (False, f, h)}
    per_expert = [numel for name, (column, i, o) in layers.items() if name in lora.target_modules
                  for numel in _adapter(lora.rank, column, i, o, 1)]
    return per_expert * (shape.num_experts // ep)


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
    (moments, plus fp32 master weights of a bf16 model; the distributed one sharded over DP). `master_weights`:
    the fp32 master weights' part of `optimizer` (0 for an fp32 model, whose weights are their own masters).
    `params`: every parameter, `trainable`: those with gradients and optimizer state (all, or LoRA's adapters)."""

    params: int
    trainable: int
    weights: int
    gradients: int
    optimizer: int
    optimizer_replicated: int
    optimizer_distributed: int
    master_weights: int


def state_bytes(shape: ModelShape, layout: Layout) -> StateBytes:
    """The model state of the largest pipeline stage's rank (Adam's per-tensor step counters are left out; the
    distributed optimizer shards the dense state over the DP x CP ranks, `Layout.dp_cp`). A MoE
    model's experts have their own grad buffer and their distributed optimizer state is sharded over the ranks
    that hold the same experts (Megatron's expert data-parallel group, `Layout.expert_dp`). With `layout.lora` the
    weights are the base's and the adapters', the gradients and optimizer state the adapters' only (a routed
    expert's adapters sharded like the expert)."""
    tp, pp, ep, etp = layout.tp, layout.pp, layout.ep, layout.expert_tp
    stage = max(range(pp), key=lambda s: sum(stage_parameter_numels(shape, tp, pp, s, ep, etp)))
    dense, experts = stage_dense_numels(shape, tp, pp, stage), stage_expert_numels(shape, etp, pp, stage, ep)
    frozen = 0
    if layout.lora.enabled:  # the base is frozen; only the adapters have gradients and optimizer state
        frozen = sum(dense) + sum(experts)
        layers = _stage_layers(shape, pp, stage)
        dense = [n for layer in layers for n in layer_adapter_numels(shape, layout.lora, tp, layer)]
        experts = [n for layer in layers for n in layer_expert_adapter_numels(shape, layout.lora, ep, layer)]
    params, expert_dp = frozen + sum(dense) + sum(experts), layout.expert_dp
    trainable = sum(dense) + sum(experts)

    def sharded(bytes_per_param: int) -> int:  # 1/(DP x CP) of the dense parameters' and 1/expert-DP of the experts'
        return math.ceil(sum(dense) * bytes_per_param / layout.dp_cp) + math.ceil(sum(experts) * bytes_per_param / expert_dp)

    moments, master = 2 * FP32, (FP32 if layout.dtype_bytes != FP32 else 0)  # exp_avg + exp_avg_sq; fp32 master
    replicated, distributed = trainable * (moments + master), sharded(moments) + sharded(master)
    gradients = grad_buffer_numel(dense, layout.dp_cp, layout.distributed_optimizer) + (
        grad_buffer_numel(experts, expert_dp, layout.distributed_optimizer) if experts else 0)
    return StateBytes(
        params=params, trainable=trainable, weights=params * layout.dtype_bytes,
        gradients=gradients * FP32,
        optimizer=distributed if layout.distributed_optimizer else replicated,
        optimizer_replicated=replicated, optimizer_distributed=distributed,
        master_weights=sharded(master) if layout.distributed_optimizer else trainable * master,
    )
