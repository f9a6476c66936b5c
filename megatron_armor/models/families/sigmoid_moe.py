"""`SigmoidMoEFamily`: routed experts behind DeepSeek-V3's sigmoid router (DeepSeek-V3 / R1, GLM-4.5 / 4.6).

The first `first_k_dense_replace` layers are dense (width `intermediate_size`), every later layer routed: sigmoid
scores per expert, the top `num_experts_per_tok` of `n_routed_experts` chosen by score plus the checkpoint's fixed
correction bias `e_score_correction_bias` among the `topk_group` best of `n_group` expert groups (a group's merit: the
sum of its two best biased scores), their unbiased scores renormalised and multiplied by `routed_scaling_factor`; plus
`n_shared_experts` shared experts (one ungated SwiGLU MLP of width `n_shared_experts * moe_intermediate_size`) that
every token passes through.

The correction bias is loaded into Megatron's `TopKRouter.expert_bias` (a persistent buffer) and kept fixed
(`moe_router_bias_update_rate` 0): RL fine-tuning keeps the pretrained routing balance, so the bias is neither
trained nor updated, and exports as loaded.

Refused by name: `norm_topk_prob` false (Megatron's sigmoid router renormalises top-k > 1 always), grouped routing whose
group merit is not the two best scores of a group (Megatron scores a group by its top `num_experts_per_tok /
topk_group`), an expert count the groups do not divide, and a `scoring_func` / `topk_method` other than `sigmoid` /
`noaux_tc` where the config names one. The multi-token-prediction layers real checkpoints hold after the last decoder
layer (`num_nextn_predict_layers`) are not built (nor by transformers' model) and not trained: conversion carries their
tensors verbatim (`convert.carried`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_armor.models.families.base import ModelConfigError
from megatron_armor.models.families.moe import MoEFamily
from megatron_armor.models.families.weights import ExpertNames
from megatron_armor.models.shape import ModelShape

SIGMOID_EXPERT_NAMES = ExpertNames(shared="shared_experts", shared_gate=None)
HF_GROUP_MERIT = 2  # HF scores an expert group by the sum of its two best (biased) expert scores
# config.json fields naming the router, where present (DeepSeek's): sigmoid scores, experts chosen by them plus the
# expert bias; DeepSeek's other methods (softmax scores; greedy or group-limited greedy choice) are not this router.
ROUTER_KIND = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}


@dataclass(frozen=True)
class SigmoidMoEFamily(MoEFamily):
    """Sigmoid-routed experts with expert bias, groups, scaling and an ungated shared expert after
    `first_k_dense_replace` dense layers; `routing_defaults` are the transformers config class's values of the routing
    fields (`n_group`, `topk_group`, `first_k_dense_replace`, `routed_scaling_factor`, `n_shared_experts`) that a
    config.json may leave out."""

    expert_names: ExpertNames = SIGMOID_EXPERT_NAMES
    routing_defaults: Mapping[str, Any] = field(default_factory=dict)

    def _expert_fields(self, hf: dict, source: str) -> dict[str, Any]:
        hf, name = {**self.routing_defaults, **hf}, self.model_type
        experts = hf.get("n_routed_experts") or hf.get("num_local_experts") or 0
        top_k, groups, group_topk = hf.get("num_experts_per_tok", 0), hf["n_group"], hf["topk_group"]
        if experts < 1 or not 1 <= top_k <= experts:
            raise ModelConfigError(f"{source}: a {name} model needs n_routed_experts >= 1 and 1 <= "
                                   f"num_experts_per_tok <= n_routed_experts; got {experts} experts, top-{top_k}")
        if not hf.get("norm_topk_prob", True) and top_k > 1:
            raise ModelConfigError(f"{source}: {name} with norm_topk_prob false is not supported; supported: "
                                   f"norm_topk_prob true (Megatron's sigmoid router renormalises its top k)")
        for key, supported in ROUTER_KIND.items():
            if hf.get(key, supported) != supported:
                raise ModelConfigError(f"{source}: {name} with {key} {hf[key]!r} is not supported; supported: "
                                       f"{supported!r} (sigmoid scores, experts chosen by them plus the expert bias)")
        if groups < 1 or experts % groups or not 1 <= group_topk <= groups:
            raise ModelConfigError(f"{source}: {name} with n_group {groups}, topk_group {group_topk} and "
                                   f"{experts} experts is not supported; supported: n_group dividing n_routed_experts, "
                                   f"1 <= topk_group <= n_group")
        if groups > 1 and top_k // group_topk != HF_GROUP_MERIT:
            raise ModelConfigError(f"{source}: {name} with n_group {groups}, topk_group {group_topk} and "
                                   f"num_experts_per_tok {top_k} is not supported; supported: num_experts_per_tok // "
                                   f"topk_group == {HF_GROUP_MERIT} (Megatron scores a group by its best "
                                   f"num_experts_per_tok // topk_group experts, HF by its best {HF_GROUP_MERIT})")
        dense, width = hf["first_k_dense_replace"], hf["moe_intermediate_size"]
        return {"num_experts": experts, "moe_top_k": top_k, "moe_ffn_hidden_size": width,
                "norm_topk_prob": True, "dense_layers": tuple(range(min(dense, hf["num_hidden_layers"]))),
                "shared_expert_ffn_hidden_size": hf["n_shared_experts"] * width,
                "expert_bias": True, "router_groups": groups, "router_group_topk": group_topk,
                "routed_scaling_factor": float(hf["routed_scaling_factor"]),
                "mtp_layers": hf.get("num_nextn_predict_layers", 0)}

    def router_fields(self, shape: ModelShape) -> dict[str, Any]:
        """Megatron's sigmoid router with its expert bias held fixed (update rate 0), groups where there are several,
        and the routed scaling factor; it renormalises the top-k scores before scaling them, as HF's."""
        groups = {"moe_router_num_groups": shape.router_groups, "moe_router_group_topk": shape.router_group_topk}
        return {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                "moe_router_bias_update_rate": 0.0, "moe_router_topk_scaling_factor": shape.routed_scaling_factor,
                **(groups if shape.router_groups > 1 else {})}
