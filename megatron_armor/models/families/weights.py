"""Building blocks of a family's weight mapping table: the `ParamMapping`s of standard attention, a dense SwiGLU MLP
and a routed-expert MLP, which a `ModelFamily` composes into its decoder layers (`ModelFamily.layer_mappings`).

Every Megatron parameter is produced from one or more HF tensors (full shapes in `hf_shapes`) by one of six
layouts (`convert.mapping` slices and joins them):

- ``replicated``: identical on every tensor-parallel (TP) rank (norm weights, routers).
- ``column``: split along dim 0 (vocab-parallel embedding / output layer).
- ``column_linear``: split along dim 0 in equal parts (multi-latent attention's column-parallel projections).
- ``row``: split along dim 1 (attention output projection, MLP down projection).
- ``qkv``: q, k, v fused per query group: for each KV group g, the rows of its ``heads_per_group`` query heads, then
  its key head, then its value head; TP ranks own contiguous groups. Applies to the weight ``[groups*(hpg+2)*d, H]``
  and the bias ``[groups*(hpg+2)*d]``.
- ``gate_up``: SwiGLU fc1; each TP rank holds ``cat(gate_shard, up_shard)``.

Megatron names follow the layer spec: Megatron's local spec keeps separate ``input_layernorm`` /
``pre_mlp_layernorm`` modules, Transformer Engine fuses them into ``linear_qkv.layer_norm_weight`` /
``linear_fc1.layer_norm_weight`` (``fused_norms``); a MoE layer's norm is a module of its own in either spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_armor.models.shape import ModelShape

Layout = Literal["replicated", "column", "column_linear", "row", "qkv", "gate_up"]


@dataclass(frozen=True)
class ParamMapping:
    """Megatron parameter `megatron_name` <-> HF tensors `hf_names` (in fusion order) of full shapes `hf_shapes`."""

    megatron_name: str
    hf_names: tuple[str, ...]
    layout: Layout
    hf_shapes: tuple[tuple[int, ...], ...]
    exported: bool = True  # False for a copy that another stage already exports (tied output layer)
    expert_rank: int | None = None  # the expert-parallel rank holding this expert (None: every EP rank has it)
    buffer: bool = False  # a persistent buffer, not a parameter: saved and loaded, never trained (no gradient)


@dataclass(frozen=True)
class EngineExpert:
    """Where one routed expert's HF projection (a checkpoint name such as ``model.layers.0.mlp.experts.3.up_proj``)
    lives in a transformers 5 model, which stacks a MoE layer's experts: the experts module ``module`` (its
    ``gate_up_proj`` [E, 2 * I, H], ``down_proj`` [E, H, I]), the expert number and the projection."""

    module: str
    expert: int
    projection: Literal["gate", "up", "down"]


@dataclass(frozen=True)
class ExpertNames:
    """How a family's HF checkpoint names a MoE block's tensors: ``model.layers.{i}.{block}.{router}.weight`` [E, H],
    ``{block}.experts.{e}.{gate|up|down}.weight``, and a shared expert's ``{block}.{shared}.{gate|up|down}.weight``
    with, where `shared_gate` is set, its sigmoid gate vector ``{block}.{shared_gate}.weight`` [1, H]; a router with
    an expert-bias correction term (`ModelShape.expert_bias`) stores it as ``{block}.{router}.{expert_bias}`` [E]."""

    block: str = "mlp"
    router: str = "gate"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    shared: str = "shared_expert"
    shared_gate: str | None = "shared_expert_gate"
    expert_bias: str = "e_score_correction_bias"


def attention_mappings(
    m: str, h: str, shape: ModelShape, fused_norms: bool
) -> tuple[list[ParamMapping], list[ParamMapping]]:
    """Standard (GQA) self-attention of the layer whose Megatron / HF prefixes are `m` / `h` and its input norm (fused
    into the QKV projection by Transformer Engine), then its optional parts (QKV bias, q/k norms), which the table
    lists after the MLP."""
    attn, hidden, d = h + "self_attn.", shape.hidden_size, shape.head_dim
    q, kv = shape.num_attention_heads * d, shape.num_kv_heads * d
    input_norm = "self_attention.linear_qkv.layer_norm_weight" if fused_norms else "input_layernorm.weight"
    mappings = [
        ParamMapping(m + input_norm, (h + "input_layernorm.weight",), "replicated", ((hidden,),)),
        ParamMapping(m + "self_attention.linear_qkv.weight",
                     (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"), "qkv",
                     ((q, hidden), (kv, hidden), (kv, hidden))),
        ParamMapping(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), "row", ((hidden, q),)),
    ]
    extras = []
    if shape.qkv_bias:
        extras.append(ParamMapping(m + "self_attention.linear_qkv.bias",
                                   (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"), "qkv",
                                   ((q,), (kv,), (kv,))))
    if shape.qk_norm:
        extras += [
            ParamMapping(m + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",), "replicated", ((d,),)),
            ParamMapping(m + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",), "replicated", ((d,),)),
        ]
    return mappings, extras


def mla_attention_mappings(m: str, h: str, shape: ModelShape, fused_norms: bool) -> list[ParamMapping]:
    """Multi-latent attention (`ModelShape.mla`, Megatron's `MLASelfAttention`) of the layer whose Megatron / HF
    prefixes are `m` / `h`, and its input norm: the query latent's down projection (HF ``q_a_proj``), its RMSNorm
    (``q_a_layernorm``) and up projection to every head's query (``q_b_proj``), the key/value latent with the shared
    rotary key (``kv_a_proj_with_mqa``: the latent's rows, then the rotary key's), its RMSNorm (``kv_a_layernorm``) and
    up projection to every head's key and value dims (``kv_b_proj``), and the output projection (``o_proj``).

    Megatron's local spec splits both down projections over TP by rows (column-parallel, outputs gathered);
    Transformer Engine's keeps them whole on every rank and fuses the latents' norms into the up projections
    (`fused_norms`). The input norm is a module of its own in either spec."""
    mla, attn, hidden, heads = shape.mla, h + "self_attn.", shape.hidden_size, shape.num_attention_heads
    down = "replicated" if fused_norms else "column_linear"
    q_norm = "linear_q_up_proj.layer_norm_weight" if fused_norms else "q_layernorm.weight"
    kv_norm = "linear_kv_up_proj.layer_norm_weight" if fused_norms else "kv_layernorm.weight"
    a = m + "self_attention."
    return [
        ParamMapping(m + "input_layernorm.weight", (h + "input_layernorm.weight",), "replicated", ((hidden,),)),
        ParamMapping(a + "linear_proj.weight", (attn + "o_proj.weight",), "row", ((hidden, heads * mla.v_head_dim),)),
        ParamMapping(a + "linear_q_down_proj.weight", (attn + "q_a_proj.weight",), down,
                     ((mla.q_lora_rank, hidden),)),
        ParamMapping(a + "linear_q_up_proj.weight", (attn + "q_b_proj.weight",), "column_linear",
                     ((heads * mla.q_head_dim, mla.q_lora_rank),)),
        ParamMapping(a + "linear_kv_down_proj.weight", (attn + "kv_a_proj_with_mqa.weight",), down,
                     ((mla.kv_lora_rank + mla.qk_rope_head_dim, hidden),)),
        ParamMapping(a + "linear_kv_up_proj.weight", (attn + "kv_b_proj.weight",), "column_linear",
                     ((heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),)),
        ParamMapping(a + q_norm, (attn + "q_a_layernorm.weight",), "replicated", ((mla.q_lora_rank,),)),
        ParamMapping(a + kv_norm, (attn + "kv_a_layernorm.weight",), "replicated", ((mla.kv_lora_rank,),)),
    ]


def dense_mlp_mappings(m: str, h: str, shape: ModelShape, fused_norms: bool) -> list[ParamMapping]:
    """A dense SwiGLU MLP of width `shape.ffn_hidden_size` and its norm (fused into fc1 by Transformer Engine)."""
    mlp_norm = "mlp.linear_fc1.layer_norm_weight" if fused_norms else "pre_mlp_layernorm.weight"
    return [ParamMapping(m + mlp_norm, (h + "post_attention_layernorm.weight",), "replicated",
                         ((shape.hidden_size,),))] + _swiglu(
        m + "mlp.", h + "mlp.", ExpertNames(), shape.ffn_hidden_size, shape.hidden_size)


def moe_mappings(m: str, h: str, shape: ModelShape, ep_size: int, names: ExpertNames) -> list[ParamMapping]:
    """A MoE layer's norm, router (and its expert-bias buffer, Megatron's `TopKRouter.expert_bias`, where
    `shape.expert_bias`) and the experts of every EP rank (HF expert ``e`` is local expert ``j`` of EP rank ``r``,
    ``e = r * experts_per_rank + j``, ``mlp.experts.local_experts.{j}``), ordered by local expert, then fc1 / fc2, then
    EP rank (a parameter's EP copies are consecutive), then the shared expert, split over TP as a dense MLP on every
    EP rank (`shape.shared_expert_ffn_hidden_size` > 0), and its gate vector where the family has one."""
    per_rank, hidden, block = shape.num_experts // ep_size, shape.hidden_size, f"{h}{names.block}."
    mappings = [
        ParamMapping(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), "replicated",
                     ((hidden,),)),
        ParamMapping(m + "mlp.router.weight", (f"{block}{names.router}.weight",), "replicated",
                     ((shape.num_experts, hidden),)),
    ]
    if shape.expert_bias:
        mappings.append(ParamMapping(m + "mlp.router.expert_bias", (f"{block}{names.router}.{names.expert_bias}",),
                                     "replicated", ((shape.num_experts,),), buffer=True))
    experts = [_swiglu(f"{m}mlp.experts.local_experts.{local}.", f"{block}experts.{rank * per_rank + local}.", names,
                       shape.moe_ffn_hidden_size, hidden, expert_rank=rank)
               for local in range(per_rank) for rank in range(ep_size)]
    mappings += [fc[i] for local in range(per_rank) for i in (0, 1)
                 for fc in experts[local * ep_size:(local + 1) * ep_size]]
    if shape.shared_expert_ffn_hidden_size:
        mappings += _swiglu(m + "mlp.shared_experts.", f"{block}{names.shared}.", names,
                            shape.shared_expert_ffn_hidden_size, hidden)
        if names.shared_gate:
            mappings.append(ParamMapping(m + "mlp.shared_experts.gate_weight", (f"{block}{names.shared_gate}.weight",),
                                         "replicated", ((1, hidden),)))
    return mappings


def _swiglu(m: str, h: str, names: ExpertNames, width: int, hidden: int, *,
            expert_rank: int | None = None) -> list[ParamMapping]:
    """fc1 (gate, up: [width, hidden] each) and fc2 (down: [hidden, width]) of one SwiGLU MLP under Megatron / HF
    prefixes `m` / `h`."""
    return [
        ParamMapping(m + "linear_fc1.weight", (f"{h}{names.gate}.weight", f"{h}{names.up}.weight"), "gate_up",
                     ((width, hidden), (width, hidden)), expert_rank=expert_rank),
        ParamMapping(m + "linear_fc2.weight", (f"{h}{names.down}.weight",), "row", ((hidden, width),),
                     expert_rank=expert_rank),
    ]
