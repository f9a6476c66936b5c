"""Qwen3 dense (model_type qwen3): RMSNorm on queries and keys, no biases."""

from megatron_armor.models.families.base import ModelFamily
from megatron_armor.models.families.registry import register_family

QWEN3 = register_family(ModelFamily(
    model_type="qwen3", config_class="Qwen3Config", qk_norm=True,
    known_shapes={
        "qwen3-8b-base": {  # Qwen/Qwen3-8B-Base
            "vocab_size": 151936, "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "max_position_embeddings": 32768,
            "rope_theta": 1000000.0, "tie_word_embeddings": False,
        },
        "qwen3-1.7b": {  # Qwen/Qwen3-1.7B
            "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 6144, "max_position_embeddings": 40960,
            "rope_theta": 1000000.0, "tie_word_embeddings": True,
        },
    },
))
