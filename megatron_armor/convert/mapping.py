"""The one table relating Hugging Face (Llama/Qwen2) parameters to Megatron-Core GPTModel ones.

Every Megatron parameter is produced from one or more HF tensors by one of five layouts:

- ``replicated``: identical on every tensor-parallel (TP) rank (norm weights).
- ``column``: split along dim 0 (vocab-parallel embedding / output layer).
- ``row``: split along dim 1 (attention output projection, MLP down projection).
- ``qkv``: q, k, v fused per query group: for each KV group g, the rows of its
  ``heads_per_group`` query heads, then its key head, then its value head; TP ranks own contiguous
  groups. Applies to the weight ``[groups*(hpg+2)*d, H]`` and the Qwen2 bias ``[groups*(hpg+2)*d]``.
- ``gate_up``: SwiGLU fc1; each TP rank holds ``cat(gate_shard, up_shard)``.

Vocabulary-parallel tensors (``column`` layout of the embedding and output layer) are padded with
zero rows to ``ModelShape.padded_vocab_size`` on import and cut back to ``vocab_size`` on export.

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


def layer_mappings(local_index: int, global_index: int, shape: ModelShape, *, fused_norms: bool = False) -> list[ParamMapping]:
    """Mappings of one decoder layer; `local_index` numbers it within this pipeline stage."""
    m, h = f"decoder.layers.{local_index}.", f"model.layers.{global_index}."
    attn = h + "self_attn."
    input_norm = "self_attention.linear_qkv.layer_norm_weight" if fused_norms else "input_layernorm.weight"
    mlp_norm = "mlp.linear_fc1.layer_norm_weight" if fused_norms else "pre_mlp_layernorm.weight"
    mappings = [
        ParamMapping(m + input_norm, (h + "input_layernorm.weight",), "replicated"),
        ParamMapping(
            m + "self_attention.linear_qkv.weight",
            (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
            "qkv",
        ),
        ParamMapping(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), "row"),
        ParamMapping(m + mlp_norm, (h + "post_attention_layernorm.weight",), "replicated"),
        ParamMapping(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), "gate_up"),
        ParamMapping(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "row"),
    ]
    if shape.qkv_bias:
        mappings.append(
            ParamMapping(
                m + "self_attention.linear_qkv.bias",
                (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"),
                "qkv",
            )
        )
    if shape.qk_norm:
        mappings += [
            ParamMapping(m + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",), "replicated"),
            ParamMapping(m + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",), "replicated"),
        ]
    return mappings


def model_mappings(
    shape: ModelShape, *, first_layer: int = 0, num_layers: int | None = None, pre_process: bool = True,
    post_process: bool = True, fused_norms: bool = False,
) -> list[ParamMapping]:
    """Mappings of one pipeline stage holding global layers [first_layer, first_layer + num_layers)."""
    num_layers = shape.num_layers if num_layers is None else num_layers
    mappings: list[ParamMapping] = []
    if pre_process:
        mappings.append(ParamMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "column"))
    for local in range(num_layers):
        mappings.extend(layer_mappings(local, first_layer + local, shape, fused_norms=fused_norms))
    if post_process:
        mappings.append(ParamMapping("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
        if not shape.tie_word_embeddings:
            mappings.append(ParamMapping("output_layer.weight", ("lm_head.weight",), "column"))
        elif not pre_process:
            # Tied embeddings under pipeline parallelism: the last stage keeps its own copy of the
            # embedding as output layer (Megatron all-reduces their grads); the first stage exports it.
            mappings.append(ParamMapping("output_layer.weight", ("model.embed_tokens.weight",), "column", exported=False))
    return mappings


def _pad_vocab(table: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """[vocab_size, H] -> [padded_vocab_size, H] with zero rows appended."""
    missing = shape.padded_vocab_size - table.shape[0]
    return torch.cat([table, table.new_zeros(missing, *table.shape[1:])]) if missing > 0 else table


def _interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """HF q [heads*d, ...], k/v [groups*d, ...] -> Megatron fused [groups*(hpg+2)*d, ...]."""
    g, d, hpg = shape.num_kv_heads, shape.head_dim, shape.heads_per_group
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(g, hpg * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)
    return fused.reshape(g * (hpg + 2) * d, *rest)


def _split_qkv(fused: torch.Tensor, shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `_interleave_qkv` on the full (all TP ranks) fused tensor."""
    g, d, hpg = shape.num_kv_heads, shape.head_dim, shape.heads_per_group
    rest = fused.shape[1:]
    q, k, v = fused.reshape(g, (hpg + 2) * d, *rest).split([hpg * d, d, d], dim=1)
    return q.reshape(g * hpg * d, *rest), k.reshape(g * d, *rest), v.reshape(g * d, *rest)


def hf_to_megatron_shard(
    mapping: ParamMapping, hf_tensors: list[torch.Tensor], shape: ModelShape, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """This TP rank's Megatron tensor for `mapping`, built from its HF tensors (in `hf_names` order)."""
    if mapping.layout == "replicated":
        return hf_tensors[0]
    if mapping.layout == "column":
        return _pad_vocab(hf_tensors[0], shape).chunk(tp_size, dim=0)[tp_rank]
    if mapping.layout == "row":
        return hf_tensors[0].chunk(tp_size, dim=1)[tp_rank]
    if mapping.layout == "qkv":
        return _interleave_qkv(*hf_tensors, shape).chunk(tp_size, dim=0)[tp_rank]
    if mapping.layout == "gate_up":
        gate, up = (t.chunk(tp_size, dim=0)[tp_rank] for t in hf_tensors)
        return torch.cat([gate, up], dim=0)
    raise ValueError(f"unknown layout {mapping.layout!r}")


def megatron_shards_to_hf(mapping: ParamMapping, shards: list[torch.Tensor], shape: ModelShape) -> list[torch.Tensor]:
    """HF tensors (in `hf_names` order) from the Megatron tensors of all TP ranks (in rank order)."""
    if mapping.layout == "replicated":
        return [shards[0]]
    if mapping.layout == "column":
        return [torch.cat(shards, dim=0)[: shape.vocab_size]]
    if mapping.layout == "row":
        return [torch.cat(shards, dim=1)]
    if mapping.layout == "qkv":
        return list(_split_qkv(torch.cat(shards, dim=0), shape))
    if mapping.layout == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]
    raise ValueError(f"unknown layout {mapping.layout!r}")
