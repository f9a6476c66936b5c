"""The weight mapping table of a model: Hugging Face parameters <-> Megatron-Core GPTModel ones, and how a TP rank's
tensor is cut from (or joined into) the HF tensors.

The decoder layers' mappings are their family's (`ModelFamily.layer_mappings`, composed of the building blocks in
`models.families.weights`, which also describes the five layouts); this module adds the embedding, the final norm
and the output layer, and slices by layout.

Mixture-of-experts layers map the router to ``mlp.router`` (replicated) and HF expert ``e`` to local expert ``j`` of
expert-parallel (EP) rank ``r`` (``e = r * experts_per_rank + j``): ``mlp.experts.local_experts.{j}.linear_fc1``
(``gate_up``) and ``linear_fc2`` (``row``). The table lists every EP rank's experts, each mapping with its
``expert_rank``; a rank builds and loads those of its own rank (`for_expert_rank`), gathering lists them all. A shared
expert is ``mlp.shared_experts.linear_fc1`` / ``linear_fc2``, split over TP as a dense MLP on every EP rank, and
Qwen2-MoE's gate vector of it ``mlp.shared_experts.gate_weight`` (replicated).

Vocabulary-parallel tensors (``column`` layout of the embedding and output layer) are padded with
zero rows to ``ModelShape.padded_vocab_size`` on import and cut back to ``vocab_size`` on export.
Import builds a TP rank's tensor from just its rows / columns of the HF tensors (``hf_shard_index``,
then ``hf_to_megatron_shard``); export joins the tensors of all TP ranks (``megatron_shards_to_hf``).

Checkpoint conversion, model loading and weight sync to rollout engines all go through here.

Why not mbridge: it is the obvious candidate (light, made for HF <-> Megatron), but its bridges
build models with the Transformer Engine layer spec unconditionally, so neither they nor their
name mapping cover the local spec that runs on CPU; and we need the same table for the TE names,
TP/PP slicing and vocabulary padding that the trainer and rollout weight sync use. One table here
serves all of them.
"""

from __future__ import annotations

import torch

from megatron_armor.models.families import model_family
from megatron_armor.models.families.weights import ParamMapping
from megatron_armor.models.shape import ModelShape


def for_expert_rank(mappings: list[ParamMapping], ep_rank: int) -> list[ParamMapping]:
    """The mappings of the parameters EP rank `ep_rank` holds: the shared ones and its own experts."""
    return [m for m in mappings if m.expert_rank in (None, ep_rank)]


def model_mappings(
    shape: ModelShape, *, first_layer: int = 0, num_layers: int | None = None, pre_process: bool = True,
    post_process: bool = True, fused_norms: bool = False, ep_size: int = 1,
) -> list[ParamMapping]:
    """Mappings of one pipeline stage holding global layers [first_layer, first_layer + num_layers), with the
    experts of all `ep_size` expert-parallel ranks (`for_expert_rank` keeps one rank's)."""
    num_layers = shape.num_layers if num_layers is None else num_layers
    family, table = model_family(shape.arch), ((shape.vocab_size, shape.hidden_size),)
    mappings: list[ParamMapping] = []
    if pre_process:
        mappings.append(ParamMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "column", table))
    for local in range(num_layers):
        layer = first_layer + local
        mappings += family.layer_mappings(f"decoder.layers.{local}.", f"model.layers.{layer}.", layer, shape,
                                          fused_norms=fused_norms, ep_size=ep_size)
    if post_process:
        mappings.append(ParamMapping("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated",
                                     ((shape.hidden_size,),)))
        if not shape.tie_word_embeddings:
            mappings.append(ParamMapping("output_layer.weight", ("lm_head.weight",), "column", table))
        elif not pre_process:
            # Tied embeddings under pipeline parallelism: the last stage keeps its own copy of the
            # embedding as output layer (Megatron all-reduces their grads); the first stage exports it.
            mappings.append(ParamMapping("output_layer.weight", ("model.embed_tokens.weight",), "column", table,
                                         exported=False))
    return mappings


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
    if mapping.layout == "column_linear":
        rows = mapping.hf_shapes[0][0] // tp_size
        return [(slice(tp_rank * rows, (tp_rank + 1) * rows),)]
    if mapping.layout == "row":
        columns = mapping.hf_shapes[0][1] // tp_size
        return [(slice(None), slice(tp_rank * columns, (tp_rank + 1) * columns))]
    if mapping.layout == "qkv":  # this rank's contiguous KV groups
        groups = shape.num_kv_heads // tp_size
        q_rows, kv_rows = groups * shape.heads_per_group * shape.head_dim, groups * shape.head_dim
        return [(slice(tp_rank * n, (tp_rank + 1) * n),) for n in (q_rows, kv_rows, kv_rows)]
    if mapping.layout == "gate_up":  # the dense MLP's or an expert's width
        rows = mapping.hf_shapes[0][0] // tp_size
        return [(slice(tp_rank * rows, (tp_rank + 1) * rows),)] * 2
    raise ValueError(f"unknown layout {mapping.layout!r}")


def hf_to_megatron_shard(
    mapping: ParamMapping, hf_parts: list[torch.Tensor], shape: ModelShape, tp_size: int
) -> torch.Tensor:
    """A TP rank's Megatron tensor for `mapping` from the parts of its HF tensors that `hf_shard_index`
    names (in `hf_names` order; read just those, e.g. with `HFCheckpointReader.get(name, index)`)."""
    if mapping.layout in ("replicated", "column_linear", "row"):
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
    if mapping.layout == "column_linear":
        return [_join(shards, dim=0)]
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
