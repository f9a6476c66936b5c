"""`MoEFamily`: a family whose MLPs are routed experts with a softmax router (Qwen2-MoE, Qwen3-MoE, Mixtral; a family
of another router overrides `router_fields`: `families.sigmoid_moe`, GLM-4.5's and DeepSeek-V3's sigmoid router)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_armor.models.families.base import ModelConfigError, ModelFamily
from megatron_armor.models.families.weights import EngineExpert, ExpertNames, ParamMapping, moe_mappings
from megatron_armor.models.layer_specs import layer_spec
from megatron_armor.models.shape import ModelShape

# A tiny test checkpoint's experts: 4 of width 32, top-2, every layer MoE, no auxiliary loss.
TINY_EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "router_aux_loss_coef": 0.0}


@dataclass(frozen=True)
class MoEFamily(ModelFamily):
    """Every layer but those in `mlp_only_layers` and those `decoder_sparse_step` skips routes each token to the
    top `num_experts_per_tok` of `num_experts` SwiGLU experts of width `moe_intermediate_size` with a softmax
    router (renormalised over the top k when `norm_topk_prob`); with `shared_expert`, a SwiGLU expert of width
    `shared_expert_intermediate_size` that every token passes through, scaled by a learned sigmoid gate, too."""

    shared_expert: bool = False
    expert_names: ExpertNames = field(default_factory=ExpertNames)  # its checkpoint's names of a MoE block

    def shape_fields(self, hf: dict, source: str) -> dict[str, Any]:
        return {**super().shape_fields(hf, source), **self._expert_fields(hf, source)}

    def _expert_fields(self, hf: dict, source: str) -> dict[str, Any]:
        """ModelShape's expert fields (transformers 5 writes the expert count as `num_local_experts`, 4.x as
        `num_experts`)."""
        experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
        top_k, step = hf.get("num_experts_per_tok", 0), hf.get("decoder_sparse_step", 1)
        if experts < 1 or not 1 <= top_k <= experts:
            raise ModelConfigError(f"{source}: a {self.model_type} model needs num_experts >= 1 and 1 <= "
                                   f"num_experts_per_tok <= num_experts; got {experts} experts, top-{top_k}")
        shared = 0
        if self.shared_expert:
            shared = hf.get("shared_expert_intermediate_size")
            if not isinstance(shared, int) or shared < 1:
                raise ModelConfigError(f"{source}: a {self.model_type} model needs shared_expert_intermediate_size "
                                       f">= 1 (its shared expert's width); got {shared!r}")
        dense = sorted(set(hf.get("mlp_only_layers") or []) | {
            layer for layer in range(hf["num_hidden_layers"]) if (layer + 1) % step})
        return {"num_experts": experts, "moe_top_k": top_k, "moe_ffn_hidden_size": hf["moe_intermediate_size"],
                "norm_topk_prob": bool(hf.get("norm_topk_prob", False)), "dense_layers": tuple(dense),
                "shared_expert_ffn_hidden_size": shared}

    def megatron_fields(self, shape: ModelShape) -> dict[str, Any]:
        """The attention's fields, the router's scores and the shared expert. HF's router takes the softmax over all
        experts, then the top k, renormalised when `norm_topk_prob`: that is Megatron's softmax over the top-k logits
        (`moe_router_pre_softmax` False) when renormalised, else its softmax before the top k. A shared expert is
        Megatron's `SharedExpertMLP` (split over TP as a dense MLP), with its sigmoid gate vector
        (`moe_shared_expert_gate`) where the checkpoint has one (`expert_names.shared_gate`)."""
        fields = super().megatron_fields(shape) | self.router_fields(shape)
        if shape.shared_expert_ffn_hidden_size:
            fields |= {"moe_shared_expert_intermediate_size": shape.shared_expert_ffn_hidden_size,
                       "moe_shared_expert_gate": self.expert_names.shared_gate is not None}
        return fields

    def router_fields(self, shape: ModelShape) -> dict[str, Any]:
        """TransformerConfig's fields of the router: a softmax router (see `megatron_fields`)."""
        return {"moe_router_score_function": "softmax", "moe_router_pre_softmax": not shape.norm_topk_prob}

    def mlp_mappings(self, m: str, h: str, layer: int, shape: ModelShape, *, fused_norms: bool,
                     ep_size: int) -> list[ParamMapping]:
        """Routed experts (and the shared expert) in a MoE layer, a dense SwiGLU MLP in `shape.dense_layers`."""
        if not shape.is_moe_layer(layer):
            return super().mlp_mappings(m, h, layer, shape, fused_norms=fused_norms, ep_size=ep_size)
        return moe_mappings(m, h, shape, ep_size, self.expert_names)

    def layer_spec(self, shape: ModelShape, layer: int, *, sequence_parallel: bool) -> ModuleSpec:
        """Megatron's GPT layer with its `MoELayer` (router, this rank's experts, the shared expert) in a MoE layer,
        with a dense MLP in `shape.dense_layers`."""
        return layer_spec(qk_layernorm=shape.qk_norm, sequence_parallel=sequence_parallel,
                          num_experts=shape.num_experts if shape.is_moe_layer(layer) else None)

    def engine_named_views(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers 5 holds a MoE layer's experts as two stacked tensors, `mlp.experts.gate_up_proj`
        [E, 2 * I, H] (each expert's gate rows, then its up rows) and `mlp.experts.down_proj` [E, H, I], and names
        the block `mlp` whatever the checkpoint calls it; these become one view per expert and projection under the
        checkpoint's names (`expert_names`): `{block}.experts.{e}.{gate}.weight` [I, H], `{up}` [I, H], `{down}`
        [H, I], and the block's other tensors (router, shared expert) are renamed to `{block}`."""
        names, views = self.expert_names, {}
        for name, tensor in params.items():
            layer, dot_mlp, rest = name.partition(".mlp.")
            block = f"{layer}.{names.block}."
            if not dot_mlp:
                views[name] = tensor
            elif rest == "experts.gate_up_proj":
                for expert, fused in enumerate(tensor):
                    gate, up = fused.chunk(2, dim=0)
                    views[f"{block}experts.{expert}.{names.gate}.weight"] = gate
                    views[f"{block}experts.{expert}.{names.up}.weight"] = up
            elif rest == "experts.down_proj":
                views.update({f"{block}experts.{expert}.{names.down}.weight": down for expert, down in enumerate(tensor)})
            else:
                views[block + rest] = tensor
        return views

    def engine_expert(self, name: str) -> EngineExpert | None:
        """`{layer}.{block}.experts.{e}.{gate|up|down}` (the checkpoint's names, `engine_named_views`) is projection
        gate, up or down of expert e in transformers 5's stacked experts `{layer}.mlp.experts`."""
        names = self.expert_names
        projections = {names.gate: "gate", names.up: "up", names.down: "down"}
        match = re.fullmatch(rf"(.+)\.{re.escape(names.block)}\.experts\.(\d+)\.(\w+)", name)
        if match is None or match.group(3) not in projections:
            return None
        return EngineExpert(f"{match.group(1)}.mlp.experts", int(match.group(2)), projections[match.group(3)])
