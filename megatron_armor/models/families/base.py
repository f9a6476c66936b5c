"""`ModelFamily`: what one Hugging Face `model_type` means to this project: its config mapping, weight mapping table,
layer spec, engine parameter names and the public shapes `armor plan` knows."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_armor.models.families.weights import (
    EngineExpert, ParamMapping, attention_mappings, dense_mlp_mappings,
)
from megatron_armor.models.layer_specs import layer_spec
from megatron_armor.models.shape import ModelShape


class ModelConfigError(ValueError):
    """An HF checkpoint whose architecture this project cannot build."""


# Megatron's RoPE scaling is Llama 3's with these fixed constants (rotary_pos_embedding._apply_scaling).
LLAMA3_ROPE_CONSTANTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def refuse_sliding_window(hf: dict, source: str, model_type: str) -> None:
    """A ModelConfigError for a set config.sliding_window (Mistral's and Mixtral's attention over a window of that
    many tokens): the Megatron model here attends to every earlier token."""
    if hf.get("sliding_window") is not None:
        raise ModelConfigError(f"{source}: {model_type} with sliding_window {hf['sliding_window']} (attention over a "
                               f"window) is not supported; supported: sliding_window null (full attention)")


@dataclass(frozen=True)
class ModelFamily:
    """An HF `model_type` this project builds (decoder-only, RoPE, RMSNorm, SwiGLU): what its config.json means
    beyond the fields every family shares (`models.hf_config.model_shape_from_dict` reads those, `shape_fields`),
    the Megatron `TransformerConfig` fields of its layers (`megatron_fields`), the weight mapping table of its decoder
    layers (`layer_mappings`, which `convert.mapping` completes with the embedding and head), its Megatron layer spec
    (`layer_spec`), its parameters' checkpoint names in an in-memory transformers model (`engine_named_views`, for
    the rollout engine's weight push), the transformers config class its tiny test checkpoints are made with
    (`models.tiny`), and the public models of the family whose shapes `armor plan` knows without a checkpoint.

    This base class is the dense family: standard attention (q/k/v biases, q/k norms as configured) and a dense
    SwiGLU MLP in every layer (`models.families.weights`, `models.layer_specs`); a family of other layers composes
    other building blocks in its own methods.
    """

    model_type: str
    config_class: str  # the transformers config class, by name (transformers loads on first use)
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2), none on the output projection
    qk_norm: bool = False  # RMSNorm over head_dim on queries and keys (Qwen3)
    # Whether HF's modelling code of the family reads config.attention_bias (biases on all four attention
    # projections, which this project does not build, so a true value is refused); Qwen2's and Qwen2-MoE's ignore
    # it (their q/k/v biases are fixed, or config.qkv_bias).
    reads_attention_bias: bool = True
    # config.json fields of a tiny test checkpoint beyond make_tiny_checkpoint's dimensions
    tiny_fields: Mapping[str, Any] = field(default_factory=dict)
    # name (matched case-insensitively in a model path) -> config.json fields of a public model (model_type implied)
    known_shapes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # the Megatron config class its layers read (multi-latent attention reads `MLATransformerConfig`)
    megatron_config_type: type[TransformerConfig] = TransformerConfig

    def shape_fields(self, hf: dict, source: str) -> dict[str, Any]:
        """The `ModelShape` fields this family decides, from config.json `hf` (read from `source`); a
        ModelConfigError for a configuration it cannot build."""
        if hf.get("mlp_bias") or (self.reads_attention_bias and hf.get("attention_bias")):
            raise ModelConfigError(f"{source}: biased {self.model_type} projections (attention_bias/mlp_bias) are "
                                   f"not supported")
        return {"qkv_bias": self.qkv_bias, "qk_norm": self.qk_norm}

    def rope_scaling_factor(self, rope: dict, source: str) -> float | None:
        """`ModelShape.rope_scaling_factor` from config.json's `rope_parameters` (or 4.x `rope_scaling`): None for
        plain RoPE, the factor for Llama 3 scaling with Megatron's constants; anything else is refused."""
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind in (None, "default"):
            return None
        if kind == "llama3" and all(float(rope.get(k, -1)) == v for k, v in LLAMA3_ROPE_CONSTANTS.items()):
            return float(rope["factor"])
        raise ModelConfigError(f"{source}: RoPE scaling {rope} is not supported; supported: none, or rope_type "
                               f"'llama3' with {LLAMA3_ROPE_CONSTANTS}")

    def megatron_fields(self, shape: ModelShape) -> dict[str, Any]:
        """The `TransformerConfig` fields of this family's layers beyond those every family shares
        (`models.hf_config.transformer_config`): the attention's q/k/v biases and q/k norms."""
        return {"add_qkv_bias": shape.qkv_bias, "qk_layernorm": shape.qk_norm}

    def layer_mappings(self, m: str, h: str, layer: int, shape: ModelShape, *, fused_norms: bool,
                       ep_size: int) -> list[ParamMapping]:
        """The weight mapping of global decoder layer `layer` under Megatron / HF name prefixes `m` / `h` (a MoE
        layer's experts: those of all `ep_size` expert-parallel ranks): attention and its input norm, the MLP and its
        norm, then attention's optional parts."""
        attention, attention_extras = attention_mappings(m, h, shape, fused_norms)
        return attention + self.mlp_mappings(m, h, layer, shape, fused_norms=fused_norms, ep_size=ep_size) + \
            attention_extras

    def mlp_mappings(self, m: str, h: str, layer: int, shape: ModelShape, *, fused_norms: bool,
                     ep_size: int) -> list[ParamMapping]:
        """The MLP of global decoder layer `layer` and its norm: a dense SwiGLU MLP."""
        del layer, ep_size
        return dense_mlp_mappings(m, h, shape, fused_norms)

    def layer_spec(self, shape: ModelShape, layer: int, *, sequence_parallel: bool) -> ModuleSpec:
        """Megatron's spec of global decoder layer `layer`: Megatron's GPT layer with a dense MLP
        (`models.layer_specs.layer_spec`)."""
        del layer
        return layer_spec(qk_layernorm=shape.qk_norm, sequence_parallel=sequence_parallel)

    def engine_named_views(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The parameters of an in-memory transformers model of this family (name -> tensor) by the HF checkpoint
        names of the weight mapping: views of them, so writing into a view writes the model (the dense families' are
        the same names)."""
        return params

    def engine_expert(self, name: str) -> EngineExpert | None:
        """Where the HF checkpoint's layer `name` (no `.weight`) sits among an in-memory transformers model's stacked
        routed experts, or None when it is not a routed expert's projection (the dense families have none)."""
        del name
        return None
