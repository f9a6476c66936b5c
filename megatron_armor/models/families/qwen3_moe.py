"""Qwen3-MoE (model_type qwen3_moe): Qwen3's attention, routed experts renormalised over the top k."""

from megatron_armor.models.families.moe import TINY_EXPERTS, MoEFamily
from megatron_armor.models.families.registry import register_family

QWEN3_MOE = register_family(MoEFamily(
    model_type="qwen3_moe", config_class="Qwen3MoeConfig", qk_norm=True,
    tiny_fields={**TINY_EXPERTS, "norm_topk_prob": True},
    known_shapes={
        "qwen3-30b-a3b": {  # Qwen/Qwen3-30B-A3B: 128 experts of width 768, 8 routed per token, every layer MoE
            "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
            "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "max_position_embeddings": 40960,
            "rope_theta": 1000000.0, "tie_word_embeddings": False, "num_experts": 128, "num_experts_per_tok": 8,
            "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        },
    },
))
