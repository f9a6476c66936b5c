"""Bytes autograd keeps for backward per micro-batch (activations), and the LM head's logits.

Counted per token of one micro-batch on one GPU, in elements of the activation dtype (`Layout.dtype_bytes`), for
each part of a decoder layer (a = heads / tp, g = kv heads / tp, d = head_dim, q = a d, k = g d, f = ffn / tp,
h = hidden, divided by tp under sequence parallelism):
  two RMSNorms          2 (3 h + 1)       input, normalised output, the residual stream; 1 = the rstd
  QKV projection        q + 2 k           its output (the QK norms read views of it)
  QK norms (Qwen3)      2 q + a + k + g   the query copy, both outputs and rstds
  core attention        q + 2 kv' + a     q, k, v (kv' = q when the local spec repeats K/V to every head, else k)
                                          and the log-sum-exp; selective recomputation keeps q + 2 k instead
  attention output      q                 the output projection's input
  SwiGLU MLP            5 f               fc1's output (2 f), silu's output, the product, a gate copy
  MoE MLP               2 E + k (2 h' + 5 f')  router scores and probabilities, and for each of the k experts a
                                          token goes to: its permuted input and output and the expert's SwiGLU. The
                                          etp ranks of the expert-TP group serving it each hold the token whole
                                          (full hidden) and moe_ffn / etp of its SwiGLU; spread evenly over the
                                          stage's ranks that is h' = h etp / tp and f' = moe_ffn / tp per token
  shared expert         5 s + h + 1       (Qwen2-MoE, s = shared ffn / tp) its SwiGLU, its output and the sigmoid
                                          gate's score, which multiply
Multi-latent attention (DeepSeek-V3; r_q, r_kv the latent ranks, a = heads / tp, e = a (d_nope + d_rope),
w = a d_v) in place of the QKV projection, QK norms and core attention:
  latents               2 r_q + 2 r_kv + 2   each latent's norm input and output (the up projection's input) and
                                          its rstd (the up projections' outputs are only split, roped and joined)
  core attention        2 e + w + a       query and key (with RoPE), value and the log-sum-exp (every head has
                                          its own key and value: nothing is repeated); selective recomputation
                                          keeps 2 e + w
  attention output      w                 the output projection's input
Full recomputation keeps only each chunk's input (h) and rebuilds one chunk's activations during its backward.

Under context parallelism (`Layout.cp` > 1) each rank holds 1 / cp of every (padded) sequence's tokens, and the
counts above are per token it holds, with one change in the core attention: the local spec's SDPAttention
all-gathers the whole sequence's keys and values and saves them repeated to every head, kv' = cp q per local token
(multi-latent attention: cp e + cp w in place of e + w; its [S / cp, S] mask is left out); Transformer Engine's
ring attention saves the local K/V only and, while one layer's attention runs, holds the K/V chunks in flight on the
ring (`ActivationBytes.exchange`: the one it attends to and the one it receives, 2 x (2 k) per local token, multi-latent
attention 2 x (e + w)). Selective recomputation keeps the core attention's local inputs only (the gather runs again
in the backward).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_armor.models.hf_config import ModelShape
from megatron_armor.planning.memory import FP32, Layout


def layer_elements_per_token(shape: ModelShape, layout: Layout, *, selective: bool = False, layer: int = 0) -> int:
    """Elements decoder layer `layer` saves for backward per token (of a CP rank's share) without full recomputation
    (module doc)."""
    tp = layout.tp
    a, g, d = shape.num_attention_heads // tp, shape.num_kv_heads // tp, shape.head_dim
    q, k, f = a * d, g * d, shape.ffn_hidden_size // tp
    h = shape.hidden_size // tp if layout.sequence_parallel else shape.hidden_size
    norms = 2 * (3 * h + 1)
    qk_norms = 2 * q + a + k + g if shape.qk_norm else 0
    core = q + 2 * k if selective else q + 2 * (q * layout.cp if layout.local_attention else k) + a
    attention = (q + 2 * k) + qk_norms + core + q
    if shape.mla is not None:
        attention = _mla_elements_per_token(shape, layout, selective)
    mlp = 5 * f
    if shape.is_moe_layer(layer):
        permuted = shape.hidden_size * layout.expert_tp // tp
        mlp = 2 * shape.num_experts + shape.moe_top_k * (2 * permuted + 5 * shape.moe_ffn_hidden_size // tp)
        if shape.shared_expert_ffn_hidden_size:  # a dense SwiGLU MLP, its output and its gate's score
            mlp += 5 * shape.shared_expert_ffn_hidden_size // tp + h + 1
    return norms + attention + mlp


def _mla_elements_per_token(shape: ModelShape, layout: Layout, selective: bool) -> int:
    """Multi-latent attention's elements per token (module doc), its output projection's input `w` included; the
    core attention's keys and values those of the whole sequence under the local spec's context parallelism."""
    mla, a = shape.mla, shape.num_attention_heads // layout.tp
    e, w = a * mla.q_head_dim, a * mla.v_head_dim
    latents = 2 * mla.q_lora_rank + 2 * mla.kv_lora_rank + 2
    gathered = layout.cp if layout.local_attention else 1  # the sequence's K/V per local token the core keeps
    core = 2 * e + w if selective else e + gathered * (e + w) + a
    return latents + core + w


def _kv_elements_per_token(shape: ModelShape, tp: int) -> int:
    """Elements of the keys and values one token has on a TP rank: 2 k (k = kv heads / tp x head_dim), multi-latent
    attention e + w (every head's own key and value)."""
    if shape.mla is not None:
        a = shape.num_attention_heads // tp
        return a * (shape.mla.q_head_dim + shape.mla.v_head_dim)
    return 2 * (shape.num_kv_heads // tp) * shape.head_dim


@dataclass(frozen=True)
class ActivationBytes:
    """Activation bytes on one GPU for its pipeline stage: `saved` (kept from the forward to the backward, for
    every micro-batch in flight), `recompute` (the working set full recomputation rebuilds during one chunk's
    backward) and `exchange` (under context parallelism with Transformer Engine's ring attention: the K/V chunks
    in flight while one layer attends); the peak is their sum."""

    saved: int
    recompute: int
    exchange: int = 0

    @property
    def peak(self) -> int:
        return self.saved + self.recompute + self.exchange


def cp_rank_tokens(layout: Layout, tokens: int) -> int:
    """Tokens a CP rank holds of a micro-batch of `tokens` (each sequence padded to a multiple of 2 x cp:
    `planner.padded_length`)."""
    return -(-tokens // layout.cp)


def layer_activation_bytes(shape: ModelShape, layout: Layout, tokens: int) -> ActivationBytes:
    """Saved, recompute and K/V exchange bytes of one pipeline stage's decoder layers for one micro-batch of
    `tokens` tokens (of a data-parallel rank; a CP rank holds `cp_rank_tokens` of them)."""
    tokens = cp_rank_tokens(layout, tokens)
    in_flight = 0 if layout.cp == 1 or layout.local_attention else 2 * _kv_elements_per_token(shape, layout.tp)
    exchange = tokens * in_flight * layout.dtype_bytes
    recompute, layers = layout.recompute, shape.num_layers // layout.pp
    full = max(layer_elements_per_token(shape, layout, selective=recompute.granularity == "selective", layer=layer)
               for layer in range(shape.num_layers))  # the largest layer's (a MoE model's may differ)
    h = shape.hidden_size // layout.tp if layout.sequence_parallel else shape.hidden_size
    if recompute.granularity != "full":
        return ActivationBytes(saved=tokens * full * layers * layout.dtype_bytes, recompute=0, exchange=exchange)
    if recompute.method == "uniform":
        chunk = min(recompute.num_layers, layers)
        kept, working = -(-layers // chunk) * h, chunk * full
    else:  # block: the first num_layers layers of the stage keep their input only
        recomputed = min(recompute.num_layers, layers)
        kept, working = recomputed * h + (layers - recomputed) * full, full if recomputed else 0
    return ActivationBytes(saved=tokens * kept * layout.dtype_bytes, recompute=tokens * working * layout.dtype_bytes,
                           exchange=exchange)


def activation_bytes(shape: ModelShape, layout: Layout, tokens: int, micro_batches: int) -> ActivationBytes:
    """Activations of the GPU with the most: under 1F1B pipelining the first stage holds min(pp, micro_batches)
    micro-batches in flight; the last stage holds one plus the final norm (the LM head is `logits_bytes`)."""
    one = layer_activation_bytes(shape, layout, tokens)
    in_flight = min(layout.pp, max(micro_batches, 1))
    h = shape.hidden_size // layout.tp if layout.sequence_parallel else shape.hidden_size
    final_norm = cp_rank_tokens(layout, tokens) * (3 * h + 1) * layout.dtype_bytes
    first = ActivationBytes(saved=one.saved * in_flight, recompute=one.recompute, exchange=one.exchange)
    last = ActivationBytes(saved=one.saved + final_norm, recompute=one.recompute, exchange=one.exchange)
    return first if layout.pp > 1 and first.peak > last.peak else last


@dataclass(frozen=True)
class LogitsBytes:
    """The LM head's bytes for one micro-batch on the last stage: `saved` for backward and `peak` while it runs
    (saved included). Torch head: fp32 [tokens, V/tp] softmax saved by the vocab-parallel cross entropy, and at
    its peak also the dtype logits and one fp32 temporary. Fused head: no logits; [tokens] fp32 vectors, and under
    sequence parallelism the hidden states it all-gathers ([tokens, h], kept for its backward)."""

    saved: int
    peak: int


def logits_bytes(shape: ModelShape, layout: Layout, tokens: int) -> LogitsBytes:
    """The head `layout.head` names, for one micro-batch of `tokens` tokens (a CP rank scores its
    `cp_rank_tokens`)."""
    tokens = cp_rank_tokens(layout, tokens)
    if layout.head == "fused":
        kept = tokens * 4 * FP32  # logprob, log-sum-exp, entropy, label logit
        kept += tokens * shape.hidden_size * layout.dtype_bytes if layout.sequence_parallel else 0
        return LogitsBytes(saved=kept, peak=kept)
    logits = tokens * (shape.padded_vocab_size // layout.tp)
    return LogitsBytes(saved=logits * FP32, peak=logits * (layout.dtype_bytes + 2 * FP32))
