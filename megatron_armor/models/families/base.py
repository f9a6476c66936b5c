"""`ModelFamily`: what one Hugging Face `model_type` means to this project."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class ModelConfigError(ValueError):
    """An HF checkpoint whose architecture this project cannot build."""


@dataclass(frozen=True)
class ModelFamily:
    """An HF `model_type` this project builds (decoder-only, RoPE, RMSNorm, SwiGLU): what its config.json means
    beyond the fields every family shares (`models.hf_config.model_shape_from_dict` reads those), the transformers
    config class its tiny test checkpoints are made with (`models.tiny`), and the public models of the family whose
    shapes `armor plan` knows without a checkpoint.

    Everything else follows from the `ModelShape` the family yields: the weight mapping (`convert.mapping`: q/k/v
    biases, q/k norms, routed and shared experts), the layer specs (`models.gpt`) and the rollout engine's parameter
    names. A family whose layers are of another kind (another attention, another router) adds a shape feature and
    its mapping there.
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

    def shape_fields(self, hf: dict, source: str) -> dict[str, Any]:
        """The `ModelShape` fields this family decides, from config.json `hf` (read from `source`); a
        ModelConfigError for a configuration it cannot build."""
        if hf.get("mlp_bias") or (self.reads_attention_bias and hf.get("attention_bias")):
            raise ModelConfigError(f"{source}: biased {self.model_type} projections (attention_bias/mlp_bias) are "
                                   f"not supported")
        return {"qkv_bias": self.qkv_bias, "qk_norm": self.qk_norm}
