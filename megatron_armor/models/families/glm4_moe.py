"""GLM-4.5 / 4.6 / GLM-4.5-Air (model_type glm4_moe).

Attention: biases on the q, k, v projections (config.attention_bias; none on the output projection), q/k RMSNorm
over head_dim where config.use_qk_norm, and RoPE on the first `partial_rotary_factor` share of each head's dims
(rotate-half; Megatron's `rotary_percent`). MLPs: the first `first_k_dense_replace` layers dense (width
`intermediate_size`), every later layer routed: sigmoid scores per expert, the top `num_experts_per_tok` of
`n_routed_experts` chosen by score plus the checkpoint's fixed correction bias `e_score_correction_bias` among the
`topk_group` best of `n_group` expert groups, their unbiased scores renormalised and multiplied by
`routed_scaling_factor`; plus `n_shared_experts` shared experts (one ungated SwiGLU MLP of width
`n_shared_experts * moe_intermediate_size`) that every token passes through.

The correction bias is loaded into Megatron's `TopKRouter.expert_bias` (a persistent buffer) and kept fixed
(`moe_router_bias_update_rate` 0): RL fine-tuning keeps the pretrained routing balance, so the bias is neither
trained nor updated, and exports as loaded.

Refused by name: `norm_topk_prob` false (Megatron's sigmoid router renormalises top-k > 1 always), grouped routing
whose group merit is not the two best scores of a group (Megatron scores a group by its top
`num_experts_per_tok / topk_group`), and an expert count the groups do not divide. The multi-token-prediction
layers real checkpoints hold after the last decoder layer (`num_nextn_predict_layers`) are not built (nor by
transformers' model) and not trained: conversion carries their tensors verbatim (`convert.carried`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_armor.models.families.base import ModelConfigError
from megatron_armor.models.families.moe import MoEFamily
from megatron_armor.models.families.registry import register_family
from megatron_armor.models.families.weights import ExpertNames
from megatron_armor.models.shape import ModelShape

GLM_EXPERT_NAMES = ExpertNames(shared="shared_experts", shared_gate=None)
HF_GROUP_MERIT = 2  # HF scores an expert group by the sum of its two best (biased) expert scores


@dataclass(frozen=True)
class Glm4MoEFamily(MoEFamily):
    """GLM-4.5's attention (q/k/v biases, optional q/k norms, partial RoPE) and sigmoid-routed experts with expert
    bias, groups, scaling and an ungated shared expert."""

    def shape_fields(self, hf: dict, source: str) -> dict[str, Any]:
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rotary = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5)))
        if not 0.0 < rotary <= 1.0:
            raise ModelConfigError(f"{source}: glm4_moe with partial_rotary_factor {rotary} is not supported; "
                                   f"supported: 0 < partial_rotary_factor <= 1")
        return {**super().shape_fields(hf, source), "qkv_bias": bool(hf.get("attention_bias", False)),
                "qk_norm": bool(hf.get("use_qk_norm", False)), "rotary_percent": rotary}

    def _expert_fields(self, hf: dict, source: str) -> dict[str, Any]:
        experts = hf.get("n_routed_experts") or hf.get("num_local_experts") or 0
        top_k, groups, group_topk = hf.get("num_experts_per_tok", 0), hf.get("n_group", 1), hf.get("topk_group", 1)
        if experts < 1 or not 1 <= top_k <= experts:
            raise ModelConfigError(f"{source}: a glm4_moe model needs n_routed_experts >= 1 and 1 <= "
                                   f"num_experts_per_tok <= n_routed_experts; got {experts} experts, top-{top_k}")
        if not hf.get("norm_topk_prob", True) and top_k > 1:
            raise ModelConfigError(f"{source}: glm4_moe with norm_topk_prob false is not supported; supported: "
                                   f"norm_topk_prob true (Megatron's sigmoid router renormalises its top k)")
        if groups < 1 or experts % groups or not 1 <= group_topk <= groups:
            raise ModelConfigError(f"{source}: glm4_moe with n_group {groups}, topk_group {group_topk} and "
                                   f"{experts} experts is not supported; supported: n_group dividing n_routed_experts, "
                                   f"1 <= topk_group <= n_group")
        if groups > 1 and top_k // group_topk != HF_GROUP_MERIT:
            raise ModelConfigError(f"{source}: glm4_moe with n_group {groups}, topk_group {group_topk} and "
                                   f"num_experts_per_tok {top_k} is not supported; supported: num_experts_per_tok // "
                                   f"topk_group == {HF_GROUP_MERIT} (Megatron scores a group by its best "
                                   f"num_experts_per_tok // topk_group experts, HF by its best {HF_GROUP_MERIT})")
        dense = hf.get("first_k_dense_replace", 1)
        return {"num_experts": experts, "moe_top_k": top_k, "moe_ffn_hidden_size": hf["moe_intermediate_size"],
                "norm_topk_prob": True, "dense_layers": tuple(range(min(dense, hf["num_hidden_layers"]))),
                "shared_expert_ffn_hidden_size": hf.get("n_shared_experts", 1) * hf["moe_intermediate_size"],
                "expert_bias": True, "router_groups": groups,
                "router_group_topk": group_topk, "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
                "mtp_layers": hf.get("num_nextn_predict_layers", 0)}

    def router_fields(self, shape: ModelShape) -> dict[str, Any]:
        """Megatron's sigmoid router with its expert bias held fixed (update rate 0), groups where there are several,
        and the routed scaling factor; it renormalises the top-k scores before scaling them, as HF's."""
        groups = {"moe_router_num_groups": shape.router_groups, "moe_router_group_topk": shape.router_group_topk}
        return {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                "moe_router_bias_update_rate": 0.0, "moe_router_topk_scaling_factor": shape.routed_scaling_factor,
                **(groups if shape.router_groups > 1 else {})}


GLM4_MOE = register_family(Glm4MoEFamily(
    model_type="glm4_moe", config_class="Glm4MoeConfig", reads_attention_bias=False, shared_expert=True,
    expert_names=GLM_EXPERT_NAMES,
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
