"""Mixtral (model_type mixtral: Mixtral-8x7B, Mixtral-8x22B): Mistral's attention and, in every layer, a softmax
router sending each token to the top `num_experts_per_tok` of `num_local_experts` SwiGLU experts of width
`intermediate_size`, their probabilities renormalised over the top k; no shared expert. The checkpoint names the
block `block_sparse_moe` and an expert's gate / up / down projections `w1` / `w3` / `w2`. Refused: a set
`sliding_window` and router jitter (`router_jitter_noise`, multiplicative noise on the router's input in training)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_armor.models.families.base import ModelConfigError, refuse_sliding_window
from megatron_armor.models.families.moe import MoEFamily
from megatron_armor.models.families.registry import register_family
from megatron_armor.models.families.weights import ExpertNames

MIXTRAL_EXPERT_NAMES = ExpertNames(block="block_sparse_moe", gate="w1", up="w3", down="w2")


@dataclass(frozen=True)
class MixtralFamily(MoEFamily):
    """Every layer MoE; the experts' width is config.intermediate_size."""

    def shape_fields(self, hf: dict, source: str) -> dict[str, Any]:
        refuse_sliding_window(hf, source, self.model_type)
        if hf.get("router_jitter_noise"):
            raise ModelConfigError(f"{source}: mixtral with router_jitter_noise {hf['router_jitter_noise']} is not "
                                   f"supported; supported: router_jitter_noise 0 (no noise on the router's input)")
        return super().shape_fields(hf, source)

    def _expert_fields(self, hf: dict, source: str) -> dict[str, Any]:
        experts, top_k = hf.get("num_local_experts", 0), hf.get("num_experts_per_tok", 0)
        if experts < 1 or not 1 <= top_k <= experts:
            raise ModelConfigError(f"{source}: a mixtral model needs num_local_experts >= 1 and 1 <= "
                                   f"num_experts_per_tok <= num_local_experts; got {experts} experts, top-{top_k}")
        return {"num_experts": experts, "moe_top_k": top_k, "moe_ffn_hidden_size": hf["intermediate_size"],
                "norm_topk_prob": True, "dense_layers": (), "shared_expert_ffn_hidden_size": 0}


MIXTRAL = register_family(MixtralFamily(
    model_type="mixtral", config_class="MixtralConfig", expert_names=MIXTRAL_EXPERT_NAMES,
    tiny_fields={"num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.0,
                 "sliding_window": None},
    known_shapes={
        "mixtral-8x7b": {  # mistralai/Mixtral-8x7B-v0.1
            "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 14336, "max_position_embeddings": 32768,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "sliding_window": None,
            "num_local_experts": 8, "num_experts_per_tok": 2,
        },
        "mixtral-8x22b": {  # mistralai/Mixtral-8x22B-v0.1
            "vocab_size": 32000, "hidden_size": 6144, "num_hidden_layers": 56, "num_attention_heads": 48,
            "num_key_value_heads": 8, "intermediate_size": 16384, "max_position_embeddings": 65536,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "sliding_window": None,
            "num_local_experts": 8, "num_experts_per_tok": 2,
        },
    },
))
