"""The one table relating Hugging Face parameters (Llama naming, which every family in `models.families` uses) to
Megatron-Core GPTModel ones; what a model has (biases, q/k norms, experts) its `ModelShape` says.

Every Megatron parameter is produced from one or more HF tensors by one of five layouts:

- ``replicated``: identical on every tensor-parallel (TP) rank (norm weights).
- ``column``: split along dim 0 (vocab-parallel embedding / output layer).
- ``row``: split along dim 1 (attention output projection, MLP down projection).
- ``qkv``: q, k, v fused per query group: for each KV group g, the rows of its
  ``heads_per_group`` query heads, then its key head, then its value head; TP ranks own contiguous
  groups. Applies to the weight ``[groups*(hpg+2)*d, H]`` and the Qwen2 bias ``[groups*(hpg+2)*d]``.
- ``gate_up``: SwiGLU fc1; each TP rank holds ``cat(gate_shard, up_shard)``.

Mixture-of-experts layers (Qwen2-MoE, Qwen3-MoE) map the router ``mlp.gate`` to ``mlp.router`` (replicated) and HF
expert ``e``'s ``mlp.experts.{e}.{gate,up,down}_proj`` to local expert ``j`` of expert-parallel (EP) rank
``r`` (``e = r * experts_per_rank + j``): ``mlp.experts.local_experts.{j}.linear_fc1`` (``gate_up``) and
``linear_fc2`` (``row``). The table lists every EP rank's experts, each mapping with its ``expert_rank``;
a rank builds and loads those of its own rank (`for_expert_rank`), gathering lists them all. Qwen2-MoE's shared
expert ``mlp.shared_expert.{gate,up,down}_proj`` is ``mlp.shared_experts.linear_fc1`` / ``linear_fc2``, split over TP
as a dense MLP on every EP rank, and its gate vector ``mlp.shared_expert_gate.weight`` [1, H] is
``mlp.shared_experts.gate_weight`` (replicated).

Vocabulary-parallel tensors (``column`` layout of the embedding and output layer) are padded with
zero rows to ``ModelShape.padded_vocab_size`` on import and cut back to ``vocab_size`` on export.
Import builds a TP rank's tensor from just its rows / columns of the HF tensors (``hf_shard_index``,
then ``hf_to_megatron_shard``); export joins the tensors of all TP ranks (``megatron_shards_to_hf``).

Checkpoint conversion, model loading and weight sync to rollout engines all go through here.
Parameter names follow the layer spec: Megatron's local spec keeps separate ``input_layernorm`` /
``pre_mlp_layernorm`` modules, Transformer Engine fuses them into ``linear_qkv.layer_norm_weight`` /
``linear_fc1.layer_norm_weight`` (``fused_norms``).

Why not mbridge: it is the obvious candidate (light, made for HF <-> Megatron), but its bridges
build models with the Transformer Engine layer spec unconditionally, so neither they nor their
name mapping cover the local spec that runs on CPU; and we need the same table for the TE names,
TP/PP slicing and vocabulary padding that the trainer and rollout weight sync use. One table here
serves all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from megatron_armor.models.hf_config import ModelShape

Layout = Literal["replicated", "column", "row", "qkv", "gate_up"]


@dataclass(frozen=True)
class ParamMapping:
    """Megatron parameter `megatron_name` <-> HF tensors `hf_names` (in fusion order)."""

    megatron_name: str
    hf_names: tuple[str, ...]
    layout: Layout
    exported: bool = True  # False for a copy that another stage already exports (tied output layer)
    expert_rank: int | None = None  # the expert-parallel rank holding this expert (None: every EP rank has it)


def layer_mappings(
    local_index: int, global_index: int, shape: ModelShape, *, fused_norms: bool = False, ep_size: int = 1
) -> list[ParamMapping]:
    """Mappings of one decoder layer; `local_index` numbers it within this pipeline stage (a MoE layer's
    experts: those of all `ep_size` expert-parallel ranks)."""
    m, h = f"decoder.layers.{local_index}.", f"model.layers.{global_index}."
    moe = shape.is_moe_layer(global_index)
    mlp = _moe_mappings(m, h, shape, ep_size) if moe else _dense_mlp_mappings(m, h, fused_norms)
    attention, attention_extras = _attention_mappings(m, h, shape, fused_norms)
    return attention + mlp + attention_extras


def _dense_mlp_mappings(m: str, h: str, fused_norms: bool) -> list[ParamMapping]:
    """A dense SwiGLU MLP and its norm (fused into fc1 by Transformer Engine)."""
    mlp_norm = "mlp.linear_fc1.layer_norm_weight" if fused_norms else "pre_mlp_layernorm.weight"
    return [
        ParamMapping(m + mlp_norm, (h + "post_attention_layernorm.weight",), "replicated"),
        ParamMapping(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), "gate_up"),
        ParamMapping(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "row"),
    ]


def _moe_mappings(m: str, h: str, shape: ModelShape, ep_size: int) -> list[ParamMapping]:
    """A MoE layer's norm (a module of its own in either spec), router and the experts of every EP rank,
    ordered by local expert, then fc1 / fc2, then EP rank (a parameter's EP copies are consecutive), then the shared
    expert (Qwen2-MoE)."""
    per_rank = shape.num_experts // ep_size
    mappings = [ParamMapping(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), "replicated"),
                ParamMapping(m + "mlp.router.weight", (h + "mlp.gate.weight",), "replicated")]
    for local in range(per_rank):
        megatron = f"{m}mlp.experts.local_experts.{local}."
        for fc, projections, layout in (("linear_fc1", ("gate_proj", "up_proj"), "gate_up"),
                                        ("linear_fc2", ("down_proj",), "row")):
            mappings += [
                ParamMapping(megatron + fc + ".weight",
                             tuple(f"{h}mlp.experts.{rank * per_rank + local}.{p}.weight" for p in projections),
                             layout, expert_rank=rank)
                for rank in range(ep_size)
            ]
    if shape.shared_expert_ffn_hidden_size:
        shared = f"{h}mlp.shared_expert."
        mappings += [
            ParamMapping(m + "mlp.shared_experts.linear_fc1.weight",
                         (shared + "gate_proj.weight", shared + "up_proj.weight"), "gate_up"),
            ParamMapping(m + "mlp.shared_experts.linear_fc2.weight", (shared + "down_proj.weight",), "row"),
            ParamMapping(m + "mlp.shared_experts.gate_weight", (h + "mlp.shared_expert_gate.weight",), "replicated"),
        ]
    return mappings


def for_expert_rank(mappings: list[ParamMapping], ep_rank: int) -> list[ParamMapping]:
    """The mappings of the parameters EP rank `ep_rank` holds: the shared ones and its own experts."""
    return [m for m in mappings if m.expert_rank in (None, ep_rank)]


def _attention_mappings(
    m: str, h: str, shape: ModelShape, fused_norms: bool
) -> tuple[list[ParamMapping], list[ParamMapping]]:
    """Self-attention and its input norm (fused into the QKV projection by Transformer Engine), then its
    optional parts (QKV bias, q/k norms), which the table lists after the MLP."""
    attn = h + "self_attn."
    input_norm = "self_attention.linear_qkv.layer_norm_weight" if fused_norms else "input_layernorm.weight"
    mappings = [
        ParamMapping(m + input_norm, (h + "input_layernorm.weight",), "replicated"),
        ParamMapping(
            m + "self_attention.linear_qkv.weight",
            (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
            "qkv",
        ),
        ParamMapping(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), "row"),
    ]
    extras = []
    if shape.qkv_bias:
        extras.append(
            ParamMapping(
                m + "self_attention.linear_qkv.bias",
                (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"),
                "qkv",
            )
        )
    if shape.qk_norm:
        extras += [
            ParamMapping(m + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",), "replicated"),
            ParamMapping(m + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",), "replicated"),
        ]
    return mappings, extras


def model_mappings(
    shape: ModelShape, *, first_layer: int = 0, num_layers: int | None = None, pre_process: bool = True,
    post_process: bool = True, fused_norms: bool = False, ep_size: int = 1,
) -> list[ParamMapping]:
    """Mappings of one pipeline stage holding global layers [first_layer, first_layer + num_layers), with the
    experts of all `ep_size` expert-parallel ranks (`for_expert_rank` keeps one rank's)."""
    num_layers = shape.num_layers if num_layers is None else num_layers
    mappings: list[ParamMapping] = []
    if pre_process:
        mappings.append(ParamMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "column"))
    for local in range(num_layers):
        mappings.extend(layer_mappings(local, first_layer + local, shape, fused_norms=fused_norms, ep_size=ep_size))
    if post_process:
        mappings.append(ParamMapping("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
        if not shape.tie_word_embeddings:
            mappings.append(ParamMapping("output_layer.weight", ("lm_head.weight",), "column"))
        elif not pre_process:
            # Tied embeddings under pipeline parallelism: the last stage keeps its own copy of the
            # embedding as output layer (Megatron all-reduces their grads); the first stage exports it.
            mappings.append(ParamMapping("output_layer.weight", ("model.embed_tokens.weight",), "column", exported=False))
    return mappings


def hf_tensor_shape(name: str, shape: ModelShape) -> tuple[int, ...]:
    """The shape config.json implies for HF tensor `name` (Llama/Qwen2/Qwen3/Qwen2-MoE/Qwen3-MoE naming)."""
    h, d = shape.hidden_size, shape.head_dim
    f = (shape.moe_ffn_hidden_size if ".mlp.experts." in name else
         shape.shared_expert_ffn_hidden_size if ".mlp.shared_expert." in name else shape.ffn_hidden_size)
    q, kv = shape.num_attention_heads * d, shape.num_kv_heads * d
    suffixes = {
        "embed_tokens.weight": (shape.vocab_size, h), "lm_head.weight": (shape.vocab_size, h),
        "q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h), "o_proj.weight": (h, q),
        "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,), "q_norm.weight": (d,), "k_norm.weight": (d,),
        "gate_proj.weight": (f, h), "up_proj.weight": (f, h), "down_proj.weight": (h, f), "layernorm.weight": (h,),
        "mlp.gate.weight": (shape.num_experts, h), "mlp.shared_expert_gate.weight": (1, h), "norm.weight": (h,),
    }  # first matching suffix wins: q_norm/k_norm and *_layernorm are listed before the final norm
    return next(value for suffix, value in suffixes.items() if name.endswith(suffix))


def _pad_rows(table: torch.Tensor, rows: int) -> torch.Tensor:
    """[n, ...] -> [rows, ...] with zero rows appended (vocabulary padding)."""
    missing = rows - table.shape[0]
    return torch.cat([table, table.new_zeros(missing, *table.shape[1:])]) if missing > 0 else table


def _interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """HF q [g*hpg*d, ...], k/v [g*d, ...] of g consecutive KV groups (all, or one TP rank's) -> Megatron
    fused [g*(hpg+2)*d, ...]."""
    d, hpg = shape.head_dim, shape.heads_per_group
    g, rest = k.shape[0] // d, q.shape[1:]
    fused = torch.cat([q.reshape(g, hpg * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)
    return fused.reshape(g * (hpg + 2) * d, *rest)


def _split_qkv(fused: torch.Tensor, shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `_interleave_qkv` on the full (all TP ranks) fused tensor."""
    g, d, hpg = shape.num_kv_heads, shape.head_dim, shape.heads_per_group
    rest = fused.shape[1:]
    q, k, v = fused.reshape(g, (hpg + 2) * d, *rest).split([hpg * d, d, d], dim=1)
    return q.reshape(g * hpg * d, *rest), k.reshape(g * d, *rest), v.reshape(g * d, *rest)


def hf_shard_index(mapping: ParamMapping, shape: ModelShape, tp_rank: int, tp_size: int) -> list[tuple[slice, ...]]:
    """Per HF tensor of `mapping` (in `hf_names` order), the index of the part that TP rank `tp_rank`'s
    Megatron tensor is built from: rows (dim 0) or, for the `row` layout, columns (dim 1)."""
    if mapping.layout == "replicated":
        return [(slice(None),)]
    if mapping.layout == "column":  # rows of the padded table; padding rows are not stored
        per_rank = shape.padded_vocab_size // tp_size
        start, stop = (min(shape.vocab_size, r * per_rank) for r in (tp_rank, tp_rank + 1))
        return [(slice(start, stop),)]
    if mapping.layout == "row":
        columns = hf_tensor_shape(mapping.hf_names[0], shape)[1] // tp_size
        return [(slice(None), slice(tp_rank * columns, (tp_rank + 1) * columns))]
    if mapping.layout == "qkv":  # this rank's contiguous KV groups
        groups = shape.num_kv_heads // tp_size
        q_rows, kv_rows = groups * shape.heads_per_group * shape.head_dim, groups * shape.head_dim
        return [(slice(tp_rank * n, (tp_rank + 1) * n),) for n in (q_rows, kv_rows, kv_rows)]
    if mapping.layout == "gate_up":  # the dense MLP's or an expert's width
        rows = hf_tensor_shape(mapping.hf_names[0], shape)[0] // tp_size
        return [(slice(tp_rank * rows, (tp_rank + 1) * rows),)] * 2
    raise ValueError(f"unknown layout {mapping.layout!r}")


def hf_to_megatron_shard(
    mapping: ParamMapping, hf_parts: list[torch.Tensor], shape: ModelShape, tp_size: int
) -> torch.Tensor:
    """A TP rank's Megatron tensor for `mapping` from the parts of its HF tensors that `hf_shard_index`
    names (in `hf_names` order; read just those, e.g. with `HFCheckpointReader.get(name, index)`)."""
    if mapping.layout in ("replicated", "row"):
        return hf_parts[0]
    if mapping.layout == "column":
        return _pad_rows(hf_parts[0], shape.padded_vocab_size // tp_size)
    if mapping.layout == "qkv":
        return _interleave_qkv(*hf_parts, shape)
    if mapping.layout == "gate_up":
        return torch.cat(hf_parts, dim=0)
    raise ValueError(f"unknown layout {mapping.layout!r}")


def megatron_shards_to_hf(mapping: ParamMapping, shards: list[torch.Tensor], shape: ModelShape) -> list[torch.Tensor]:
    """HF tensors (in `hf_names` order) from the Megatron tensors of all TP ranks (in rank order).

    From one shard (no TP), all but a split fused QKV of several KV groups are views of it."""
    if mapping.layout == "replicated":
        return [shards[0]]
    if mapping.layout == "column":
        return [_join(shards, dim=0)[: shape.vocab_size]]
    if mapping.layout == "row":
        return [_join(shards, dim=1)]
    if mapping.layout == "qkv":
        return list(_split_qkv(_join(shards, dim=0), shape))
    if mapping.layout == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [_join([h[0] for h in halves], dim=0), _join([h[1] for h in halves], dim=0)]
    raise ValueError(f"unknown layout {mapping.layout!r}")


def _join(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    """torch.cat, except that a single tensor comes back as it is (no copy)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)
