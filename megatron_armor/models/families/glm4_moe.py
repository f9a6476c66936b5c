"""GLM-4.5 / 4.6 / GLM-4.5-Air (model_type glm4_moe).

Attention: biases on the q, k, v projections (config.attention_bias; none on the output projection), q/k RMSNorm
over head_dim where config.use_qk_norm, and RoPE on the first `partial_rotary_factor` share of each head's dims
(rotate-half; Megatron's `rotary_percent`). MLPs: DeepSeek-V3's sigmoid-routed experts after the first
`first_k_dense_replace` dense layers, with expert bias, groups, scaling and an ungated shared expert
(`families.sigmoid_moe`, which also says what is refused and how the multi-token-prediction layers are carried).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_armor.models.families.base import ModelConfigError
from megatron_armor.models.families.registry import register_family
from megatron_armor.models.families.sigmoid_moe import SigmoidMoEFamily


@dataclass(frozen=True)
class Glm4MoEFamily(SigmoidMoEFamily):
    """GLM-4.5's attention (q/k/v biases, optional q/k norms, partial RoPE) before sigmoid-routed experts."""

    def shape_fields(self, hf: dict, source: str) -> dict[str, Any]:
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rotary = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5)))
        if not 0.0 < rotary <= 1.0:
            raise ModelConfigError(f"{source}: glm4_moe with partial_rotary_factor {rotary} is not supported; "
                                   f"supported: 0 < partial_rotary_factor <= 1")
        return {**super().shape_fields(hf, source), "qkv_bias": bool(hf.get("attention_bias", False)),
                "qk_norm": bool(hf.get("use_qk_norm", False)), "rotary_percent": rotary}


GLM4_MOE = register_family(Glm4MoEFamily(
    model_type="glm4_moe", config_class="Glm4MoeConfig", reads_attention_bias=False, shared_expert=True,
    routing_defaults={"n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 1.0,
                      "n_shared_experts": 1},
    tiny_fields={"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
                 "first_k_dense_replace": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_group": 1,
                 "topk_group": 1, "attention_bias": True, "use_qk_norm": True, "partial_rotary_factor": 0.5,
                 "num_nextn_predict_layers": 0},
    known_shapes={
        "glm-4.5-air": {  # zai-org/GLM-4.5-Air: 106B parameters, 12B active
            "vocab_size": 151552, "hidden_size": 4096, "num_hidden_layers": 46, "num_attention_heads": 96,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 10944, "max_position_embeddings": 131072,
            "rope_theta": 1000000, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": True,
            "use_qk_norm": False, "partial_rotary_factor": 0.5, "n_routed_experts": 128, "num_experts_per_tok": 8,
            "moe_intermediate_size": 1408, "n_shared_experts": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
            "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 1,
        },
        "glm-4.5": {  # zai-org/GLM-4.5: 355B parameters, 32B active
            "vocab_size": 151552, "hidden_size": 5120, "num_hidden_layers": 92, "num_attention_heads": 96,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "max_position_embeddings": 131072,
            "rope_theta": 1000000, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": True,
            "use_qk_norm": True, "partial_rotary_factor": 0.5, "n_routed_experts": 160, "num_experts_per_tok": 8,
            "moe_intermediate_size": 1536, "n_shared_experts": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
            "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 1,
        },
    },
))
