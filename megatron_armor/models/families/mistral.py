"""Mistral (model_type mistral: Mistral-7B-v0.2/v0.3 and its fine-tunes): Llama's layers; attention over a sliding
window when config.sliding_window is set (v0.1), which is refused: the Megatron model here attends to every
earlier token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_armor.models.families.base import ModelFamily, refuse_sliding_window
from megatron_armor.models.families.registry import register_family


@dataclass(frozen=True)
class MistralFamily(ModelFamily):
    """Refuses a set `sliding_window` (MistralConfig's default is 4096; the v0.2+ releases write null)."""

    def shape_fields(self, hf: dict, source: str) -> dict[str, Any]:
        refuse_sliding_window(hf, source, self.model_type)
        return super().shape_fields(hf, source)


MISTRAL = register_family(MistralFamily(
    model_type="mistral", config_class="MistralConfig", tiny_fields={"sliding_window": None},
    known_shapes={
        "mistral-7b-v0.3": {  # mistralai/Mistral-7B-v0.3
            "vocab_size": 32768, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336, "max_position_embeddings": 32768,
            "rope_theta": 1000000.0, "tie_word_embeddings": False, "sliding_window": None,
        },
    },
))
