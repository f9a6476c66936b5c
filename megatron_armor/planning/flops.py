"""Training FLOPs of a decoder (Megatron-LM's `num_floating_point_operations`, `transformer_flops` for a model
without MTP or linear attention), and of one RL step. One place, used by the planner and by the
trainer's `perf/tflops_per_gpu`.

Per real token, forward + backward (3x the forward; 2 FLOPs per multiply-add), L layers, hidden h, SwiGLU:
    6 h (3 ffn L + L (q + 2 kv + q) + V_pad)  + per sequence of length s: 6 q L s^2 / 2 * 2
with q = heads * head_dim, kv = kv_heads * head_dim; the causal core attention counts half the s x s scores. In a
MoE layer the MLP term 3 ffn is each token's k experts' 3 k moe_ffn plus the router's E (as Megatron-LM counts), and
with a shared expert (Qwen2-MoE) its 3 shared_ffn plus its gate's 1. Multi-latent attention (DeepSeek-V3) replaces
h (q + 2 kv + q) by its five projections, h r_q + r_q n e + h (r_kv + p) + r_kv n (d_nope + d_v) + n d_v h (n heads,
e = d_nope + p query/key dims), and the core attention's q by n (e + d_v) / 2 (QK^T over e dims, the values' d_v).
Model FLOPs: recomputation and padding tokens are not counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_armor.models.families import model_family
from megatron_armor.models.hf_config import ModelShape

FORWARD_BACKWARD = 3  # backward = 2x forward
FMA = 2  # FLOPs per multiply-add


def forward_backward_flops(shape: ModelShape, total_tokens: int, seqlen_squared_sum: int) -> float:
    """FLOPs of a forward + backward pass over sequences with `total_tokens` real tokens in all and
    sum(len^2) = `seqlen_squared_sum` (Megatron's THD accounting; a padded batch of b sequences of length s
    is b*s and b*s^2)."""
    layers, hidden = shape.num_layers, shape.hidden_size
    projections, core_width = attention_widths(shape)
    per_token = FORWARD_BACKWARD * FMA * (
        hidden * mlp_width(shape)  # SwiGLU: gate, up, down (of the experts a token is routed to) and routers
        + layers * projections  # QKV and output projections
        + hidden * shape.padded_vocab_size  # LM head
    )
    core_attention = FORWARD_BACKWARD * FMA * core_width / 2 * 2 * layers  # causal half of QK^T and of (QK^T)V
    return total_tokens * per_token + seqlen_squared_sum * core_attention


def attention_widths(shape: ModelShape) -> tuple[int, int]:
    """(multiply-adds per token of one layer's attention projections, of its core attention per earlier token
    attended, halved: `q` in standard attention) (module doc)."""
    if shape.mla is None:
        q, kv = shape.head_dim * shape.num_attention_heads, shape.head_dim * shape.num_kv_heads
        return shape.hidden_size * (q + 2 * kv) + q * shape.hidden_size, q
    mla, n, h = shape.mla, shape.num_attention_heads, shape.hidden_size
    projections = (h * mla.q_lora_rank + mla.q_lora_rank * n * mla.q_head_dim
                   + h * (mla.kv_lora_rank + mla.qk_rope_head_dim)
                   + mla.kv_lora_rank * n * (mla.qk_nope_head_dim + mla.v_head_dim) + n * mla.v_head_dim * h)
    return projections, n * (mla.q_head_dim + mla.v_head_dim) // 2


def mlp_width(shape: ModelShape) -> int:
    """Sum over the decoder layers of the multiply-adds per token and hidden unit of its MLP: 3 ffn in a dense
    layer, 3 k moe_ffn + E (the router) in a MoE layer, plus 3 shared_ffn (+ 1, its gate, where it has one) with a
    shared expert."""
    shared = shape.shared_expert_ffn_hidden_size
    gate = 1 if shared and model_family(shape.arch).expert_names.shared_gate else 0  # Qwen2-MoE's; GLM's has none
    moe = 3 * shape.moe_top_k * shape.moe_ffn_hidden_size + shape.num_experts + 3 * shared + gate
    return sum(moe if shape.is_moe_layer(layer) else 3 * shape.ffn_hidden_size for layer in range(shape.num_layers))


def forward_flops(shape: ModelShape, total_tokens: int, seqlen_squared_sum: int) -> float:
    """FLOPs of a forward-only pass (a logprob pass): a third of `forward_backward_flops`."""
    return forward_backward_flops(shape, total_tokens, seqlen_squared_sum) / FORWARD_BACKWARD


@dataclass(frozen=True)
class RLStepFlops:
    """FLOPs of one RL step's training side (rollout generation not counted), by pass: `update` (forward +
    backward of the policy loss over every sample), `old_logprobs` (forward of the actor before the update),
    `reference` and `teacher` (forward of the frozen models, 0 when the algorithm needs none)."""

    update: float
    old_logprobs: float
    reference: float = 0.0
    teacher: float = 0.0

    @property
    def total(self) -> float:
        return self.update + self.old_logprobs + self.reference + self.teacher


def rl_step_flops(
    shape: ModelShape, lengths: Sequence[int], *, reference: bool, teacher: ModelShape | None = None,
    old_logprobs: bool = True,
) -> RLStepFlops:
    """FLOPs of one RL step over sequences of `lengths` tokens (prompt + response, all data-parallel ranks):
    one update pass, an old-policy logprob pass (unless the update gives them: `old_logprobs` False), and a
    reference / `teacher` logprob pass when asked."""
    tokens, squares = sum(lengths), sum(n * n for n in lengths)
    forward = forward_flops(shape, tokens, squares)
    return RLStepFlops(
        update=forward_backward_flops(shape, tokens, squares), old_logprobs=forward if old_logprobs else 0.0,
        reference=forward if reference else 0.0,
        teacher=forward_flops(teacher, tokens, squares) if teacher is not None else 0.0,
    )
