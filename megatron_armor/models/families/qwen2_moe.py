"""Qwen2-MoE (model_type qwen2_moe: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): q/k/v biases (config.qkv_bias, on unless
false), routed experts not renormalised over the top k (as the releases), and a sigmoid-gated shared expert in every
MoE layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_armor.models.families.moe import TINY_EXPERTS, MoEFamily
from megatron_armor.models.families.registry import register_family


@dataclass(frozen=True)
class Qwen2MoEFamily(MoEFamily):
    """Qwen2-MoE's q/k/v biases are config.qkv_bias (absent: on)."""

    def shape_fields(self, hf: dict, source: str) -> dict[str, Any]:
        return {**super().shape_fields(hf, source), "qkv_bias": bool(hf.get("qkv_bias", True))}


QWEN2_MOE = register_family(Qwen2MoEFamily(
    model_type="qwen2_moe", config_class="Qwen2MoeConfig", qkv_bias=True, reads_attention_bias=False,
    shared_expert=True,
    tiny_fields={**TINY_EXPERTS, "norm_topk_prob": False, "shared_expert_intermediate_size": 48},
))
