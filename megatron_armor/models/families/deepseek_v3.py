"""DeepSeek-V3 / R1 and models of the same architecture (model_type deepseek_v3).

Attention: multi-latent attention (`ModelShape.mla`, Megatron's `MLASelfAttention`): queries from a `q_lora_rank`
latent, keys and values from a `kv_lora_rank` latent, both RMSNormed and up-projected per head
(`qk_nope_head_dim` + `qk_rope_head_dim` query/key dims, `v_head_dim` value dims), RoPE on the decoupled
`qk_rope_head_dim` dims only, in interleaved pairs (`rope_interleave`), plain or YaRN-scaled (`rope_type` yarn: the
factor, `original_max_position_embeddings`, `beta_fast` / `beta_slow`, `mscale` / `mscale_all_dim`). MLPs:
`first_k_dense_replace` dense layers, then sigmoid-routed experts with expert bias, group-limited top-k, normalised
top-k, the routed scaling factor and one ungated shared expert (`families.sigmoid_moe`).

Multi-token-prediction layers (`num_nextn_predict_layers`, `model.layers.{num_hidden_layers + i}.*`): not built
(nor by transformers' model) and not trained; conversion carries their tensors bit for bit (`convert.carried`).

Refused by name: quantised weights (`quantization_config`: the fp8 releases, cast them to bf16 first), a query without
its latent (`q_lora_rank` null, DeepSeek-V2-Lite), `rope_interleave` false (Megatron's MLA rotates interleaved pairs),
`num_key_value_heads` other than `num_attention_heads`, a RoPE type other than default / yarn and YaRN with an explicit
`attention_factor`, `truncate` false or an `mscale_all_dim` without its `mscale` (Megatron's YaRN scales those otherwise
than transformers'), `moe_layer_freq` other than 1, biased projections, and the routing options `families.sigmoid_moe`
refuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import MLATransformerConfig

from megatron_armor.models.families.base import ModelConfigError
from megatron_armor.models.families.registry import register_family
from megatron_armor.models.families.sigmoid_moe import SigmoidMoEFamily
from megatron_armor.models.families.weights import ParamMapping, mla_attention_mappings
from megatron_armor.models.layer_specs import layer_spec
from megatron_armor.models.shape import MLAShape, ModelShape

YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0}  # transformers' (and Megatron's) when config.json has none


@dataclass(frozen=True)
class DeepseekV3Family(SigmoidMoEFamily):
    """Multi-latent attention (plain or YaRN RoPE) before sigmoid-routed experts."""

    def shape_fields(self, hf: dict, source: str) -> dict[str, Any]:
        for key, supported in (("rope_interleave", True), ("moe_layer_freq", 1)):
            if hf.get(key, supported) != supported:
                raise ModelConfigError(f"{source}: deepseek_v3 with {key} {hf[key]!r} is not supported; supported: "
                                       f"{key} {supported!r}")
        if hf.get("quantization_config"):  # the released DeepSeek-V3 / R1 checkpoints: fp8 blocks with their scales
            raise ModelConfigError(f"{source}: deepseek_v3 with quantization_config {hf['quantization_config']} is not "
                                   f"supported; supported: none (bf16 or fp32 weights: cast the fp8 release to bf16 "
                                   f"first)")
        if hf.get("q_lora_rank") is None:
            raise ModelConfigError(f"{source}: deepseek_v3 with q_lora_rank None (queries without a latent) is not "
                                   f"supported; supported: q_lora_rank >= 1")
        heads = hf["num_attention_heads"]
        if hf.get("num_key_value_heads", heads) != heads:
            raise ModelConfigError(f"{source}: deepseek_v3 with num_key_value_heads {hf['num_key_value_heads']} is not "
                                   f"supported; supported: num_key_value_heads == num_attention_heads ({heads})")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        mla = MLAShape(q_lora_rank=hf["q_lora_rank"], kv_lora_rank=hf["kv_lora_rank"],
                       qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                       v_head_dim=hf["v_head_dim"], **_yarn_fields(rope, source))
        return {**super().shape_fields(hf, source), "mla": mla}

    def rope_scaling_factor(self, rope: dict, source: str) -> float | None:
        """None: YaRN is multi-latent attention's own (`MLAShape`, which `shape_fields` reads and where any other
        scaling is refused)."""
        del rope, source
        return None

    def megatron_fields(self, shape: ModelShape) -> dict[str, Any]:
        """`MLATransformerConfig`'s fields: the latent ranks, head dims and RoPE (YaRN's where scaled); the latents'
        RMSNorms are its `qk_layernorm`; then the router's and the shared expert's (`SigmoidMoEFamily`)."""
        mla = shape.mla
        rope = {"rope_type": "rope"} if mla.yarn_factor is None else {
            "rope_type": "yarn", "rotary_scaling_factor": mla.yarn_factor,
            "original_max_position_embeddings": mla.yarn_original_max_position_embeddings,
            "beta_fast": mla.yarn_beta_fast, "beta_slow": mla.yarn_beta_slow, "mscale": mla.yarn_mscale,
            "mscale_all_dim": mla.yarn_mscale_all_dim}
        return super().megatron_fields(shape) | rope | {
            "multi_latent_attention": True, "q_lora_rank": mla.q_lora_rank, "kv_lora_rank": mla.kv_lora_rank,
            "qk_head_dim": mla.qk_nope_head_dim, "qk_pos_emb_head_dim": mla.qk_rope_head_dim,
            "v_head_dim": mla.v_head_dim, "rotary_base": shape.rope_theta, "qk_layernorm": True}

    def layer_mappings(self, m: str, h: str, layer: int, shape: ModelShape, *, fused_norms: bool,
                       ep_size: int) -> list[ParamMapping]:
        """Multi-latent attention and its input norm, then the MLP and its norm."""
        return mla_attention_mappings(m, h, shape, fused_norms) + self.mlp_mappings(
            m, h, layer, shape, fused_norms=fused_norms, ep_size=ep_size)

    def layer_spec(self, shape: ModelShape, layer: int, *, sequence_parallel: bool) -> ModuleSpec:
        """Megatron's GPT layer with `MLASelfAttention` (its latents' norms) and a `MoELayer` or, in
        `shape.dense_layers`, a dense MLP."""
        return layer_spec(qk_layernorm=True, multi_latent_attention=True, sequence_parallel=sequence_parallel,
                          num_experts=shape.num_experts if shape.is_moe_layer(layer) else None)


def _yarn_fields(rope: dict, source: str) -> dict[str, Any]:
    """`MLAShape`'s YaRN fields from config.json's rope parameters (none for plain RoPE); a ModelConfigError for
    another RoPE type, or a YaRN option Megatron's `YarnRotaryEmbedding` computes differently from transformers."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return {}
    if kind != "yarn":
        raise ModelConfigError(f"{source}: deepseek_v3 with rope_type {kind!r} is not supported; supported: "
                               f"'default', 'yarn'")
    factor, mscale, mscale_all_dim = rope.get("factor"), rope.get("mscale"), rope.get("mscale_all_dim")
    if not isinstance(factor, int | float) or factor <= 1:
        _refuse_yarn(source, "factor", factor, "a number > 1")
    if rope.get("attention_factor") is not None:
        _refuse_yarn(source, "attention_factor", rope["attention_factor"], "None (derived from the mscales)")
    if rope.get("truncate", True) is not True:
        _refuse_yarn(source, "truncate", rope["truncate"], "true")
    if mscale_all_dim and not mscale:  # transformers then scales cos/sin by mscale(factor, 1) alone
        _refuse_yarn(source, "mscale", mscale, f"a number beside mscale_all_dim {mscale_all_dim}")
    return {"yarn_factor": float(rope["factor"]),
            "yarn_original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
            "yarn_beta_fast": float(rope.get("beta_fast") or YARN_DEFAULTS["beta_fast"]),
            "yarn_beta_slow": float(rope.get("beta_slow") or YARN_DEFAULTS["beta_slow"]),
            # transformers reads mscale only beside mscale_all_dim (else cos/sin scale by mscale(factor, 1))
            "yarn_mscale": float(mscale) if mscale_all_dim else 1.0,
            "yarn_mscale_all_dim": float(mscale_all_dim or 0.0)}


def _refuse_yarn(source: str, key: str, value: Any, supported: str) -> None:
    raise ModelConfigError(f"{source}: deepseek_v3 with yarn {key} {value!r} is not supported; supported: {supported}")


DEEPSEEK_V3 = register_family(DeepseekV3Family(
    model_type="deepseek_v3", config_class="DeepseekV3Config", shared_expert=True,
    megatron_config_type=MLATransformerConfig,
    routing_defaults={"n_group": 8, "topk_group": 4, "first_k_dense_replace": 3, "routed_scaling_factor": 2.5,
                      "n_shared_experts": 1},
    tiny_fields={
        "num_key_value_heads": 4, "head_dim": 8, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "rope_interleave": True,
        # YaRN with both mscales set (DeepSeek-V3's form): the rotary cos/sin and the softmax are both rescaled
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                            "mscale": 0.8, "mscale_all_dim": 1.0},
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 0},
    known_shapes={
        "deepseek-v3": {  # deepseek-ai/DeepSeek-V3 (and -R1, -V3-0324, -V3.1: the same config): 671B parameters,
            # 37B active, plus one 14B multi-token-prediction layer (not built)
            "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
            "num_hidden_layers": 61, "num_nextn_predict_layers": 1, "num_attention_heads": 128,
            "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
            "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
            "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
            "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
            "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
            "rope_theta": 10000,
            "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
            "tie_word_embeddings": False, "attention_bias": False,
        },
    },
))
