"""`recompute`: Megatron's activation recomputation, which activations the backward recomputes instead of keeping.

The section is what `models.hf_config.transformer_config` reads (`megatron_fields`); no other class repeats its
fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_armor.config.base import check_choices, doc, require_at_least


@dataclass(frozen=True)
class RecomputeConfig:
    """Activation recomputation in the backward (Megatron's recompute_granularity / _method / _num_layers)."""

    granularity: Literal["none", "selective", "full"] = doc(
        "none", "none, selective (the core attention of every layer, Megatron's default recompute_modules; runs with "
        "the local layer spec, no Transformer Engine needed) or full (whole layers, see method)"
    )
    method: Literal["uniform", "block"] = doc(
        "uniform", "granularity full: uniform (every layer, in chunks of num_layers layers) or block (only the first "
        "num_layers layers of each pipeline stage)"
    )
    num_layers: int = doc(1, "granularity full: layers per chunk (uniform) or recomputed layers (block)")

    def __post_init__(self) -> None:
        check_choices("recompute", self)
        require_at_least("recompute", self, ("num_layers",), 1)

    def megatron_fields(self) -> dict:
        """TransformerConfig's recompute_granularity / recompute_method / recompute_num_layers."""
        if self.granularity == "none":
            return {}
        if self.granularity == "selective":
            return {"recompute_granularity": "selective"}
        return {"recompute_granularity": "full", "recompute_method": self.method,
                "recompute_num_layers": self.num_layers}
