"""Qwen2 / Qwen2.5 (model_type qwen2): biases on the q, k, v projections."""

from megatron_armor.models.families.base import ModelFamily
from megatron_armor.models.families.registry import register_family

QWEN2 = register_family(ModelFamily(
    model_type="qwen2", config_class="Qwen2Config", qkv_bias=True, reads_attention_bias=False,
    known_shapes={
        "qwen2.5-math-7b": {  # Qwen/Qwen2.5-Math-7B
            "vocab_size": 152064, "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
            "num_key_value_heads": 4, "intermediate_size": 18944, "max_position_embeddings": 4096,
            "rope_theta": 10000.0, "tie_word_embeddings": False,
        },
    },
))
