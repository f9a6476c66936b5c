"""Model families (`models.families`): each registered family reads its config.json into the shape whose weight
mapping names exactly the tensors transformers' own model of that type has, and what a family cannot build is
refused by name."""

import math

import pytest
from safetensors.torch import load_file

from megatron_armor.convert.mapping import model_mappings
from megatron_armor.models.families import (
    ModelConfigError, ModelFamily, known_shapes, model_family, register_family, registered_families, unregister_family,
)
from megatron_armor.models.hf_config import load_model_shape, model_shape_from_dict
from megatron_armor.planning.flops import forward_backward_flops
from megatron_armor.planning.memory import parameter_count
from megatron_armor.planning.shapes import resolve_model_shape

BUILT_IN = ["deepseek_v3", "glm4_moe", "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"]
DENSE = {"num_attention_heads": 4, "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 128,
         "intermediate_size": 64}
GLM = {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}  # glm4_moe's expert fields
# deepseek_v3's latent attention and expert fields (one expert group: the config class's default is 8)
DEEPSEEK = {**GLM, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8, "v_head_dim": 16, "n_group": 1, "topk_group": 1}
YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
        "mscale_all_dim": 1.0}


def test_the_built_in_families_are_registered():
    assert sorted(registered_families()) == BUILT_IN


@pytest.mark.parametrize("model_type", BUILT_IN)
def test_a_family_s_shape_maps_exactly_the_tensors_of_transformers_model(model_type, tiny_model_factory):
    """The tiny checkpoint is transformers' model of `model_type` (its own config class and modelling code): the
    tensors the family's shape maps (biases, q/k norms, experts, shared expert) are the ones it saved, with the
    shapes the mapping expects."""
    model_dir = tiny_model_factory(model_type)
    shape = load_model_shape(model_dir)
    assert shape.arch == model_type
    saved = load_file(model_dir / "model.safetensors")
    mapped = {name for m in model_mappings(shape) if m.exported for name in m.hf_names}
    assert mapped == set(saved)
    features = {"qkv_bias": any(name.endswith("q_proj.bias") for name in saved),
                "qk_norm": any(name.endswith("q_norm.weight") for name in saved),
                "experts": any(".experts." in name for name in saved),
                "shared_expert": any(".shared_expert" in name for name in saved)}
    assert features == {"qkv_bias": shape.qkv_bias, "qk_norm": shape.qk_norm, "experts": shape.num_experts > 0,
                        "shared_expert": shape.shared_expert_ffn_hidden_size > 0}


@pytest.mark.parametrize("model_type", registered_families())
def test_config_mapping_weight_mapping_and_planner_agree_on_the_parameter_count(model_type, tiny_model_factory):
    """Every registered family's tiny model (transformers' own, from its config class): each tensor the weight
    mapping names has the shape the mapping gives it, and the parameter count that transformers saved, the mapping's
    and the planner's (less the vocabulary padding rows of the embedding and output layer, plus the buffers both
    checkpoints hold and nothing trains: GLM's expert bias) are one number."""
    model_dir = tiny_model_factory(model_type)
    shape = load_model_shape(model_dir)
    saved = load_file(model_dir / "model.safetensors")
    mapped = {name: tensor_shape for m in model_mappings(shape) if m.exported
              for name, tensor_shape in zip(m.hf_names, m.hf_shapes)}
    assert {name: tuple(tensor.shape) for name, tensor in saved.items()} == mapped
    padding = 2 * (shape.padded_vocab_size - shape.vocab_size) * shape.hidden_size
    buffers = sum(math.prod(tensor_shape) for m in model_mappings(shape) if m.buffer for tensor_shape in m.hf_shapes)
    assert sum(t.numel() for t in saved.values()) == sum(map(math.prod, mapped.values())) == \
        parameter_count(shape) - padding + buffers
    assert buffers == (shape.num_experts * sum(map(shape.is_moe_layer, range(shape.num_layers)))
                       if shape.expert_bias else 0)


def test_every_known_shape_reads_into_its_family_and_the_planner_finds_it_by_name():
    shapes = known_shapes()
    assert {"qwen2.5-math-7b", "qwen3-8b-base", "qwen3-1.7b", "qwen3-30b-a3b", "mistral-7b-v0.3", "mixtral-8x7b",
            "mixtral-8x22b", "glm-4.5", "glm-4.5-air", "deepseek-v3"} <= set(shapes)
    for name, fields in shapes.items():
        shape = model_shape_from_dict(fields, source=name)
        assert resolve_model_shape(f"/hub/{name.upper()}")[0] == shape, name
    mistral = resolve_model_shape("mistralai/Mistral-7B-v0.3")[0]
    assert (mistral.arch, mistral.num_kv_heads, mistral.head_dim, mistral.qkv_bias) == ("mistral", 8, 128, False)
    mixtral = resolve_model_shape("mistralai/Mixtral-8x22B-v0.1")[0]  # 141B parameters, 39B active (Mistral AI)
    assert (mixtral.arch, mixtral.num_experts, mixtral.moe_top_k, mixtral.moe_ffn_hidden_size) == ("mixtral", 8, 2, 16384)
    assert round(parameter_count(mixtral) / 1e9) == 141
    assert round(parameter_count(resolve_model_shape("Mixtral-8x7B-Instruct-v0.1")[0]) / 1e9, 1) == 46.7
    # GLM-4.5 and GLM-4.5-Air (Z.ai: 355B and 106B parameters) without their multi-token-prediction layer (not built)
    glm, air = resolve_model_shape("zai-org/GLM-4.5")[0], resolve_model_shape("zai-org/GLM-4.5-Air-FP8")[0]
    assert (glm.arch, glm.num_experts, glm.moe_top_k, glm.dense_layers, glm.rotary_percent, glm.qk_norm,
            glm.routed_scaling_factor) == ("glm4_moe", 160, 8, (0, 1, 2), 0.5, True, 2.5)
    assert (air.num_experts, air.dense_layers, air.qk_norm, air.qkv_bias) == (128, (0,), False, True)
    assert round(parameter_count(glm) / 1e9) == 353 and round(parameter_count(air) / 1e9) == 107
    # DeepSeek-V3 / R1 (DeepSeek: 671B parameters, 37B active, without the 14B multi-token-prediction layer)
    v3 = resolve_model_shape("deepseek-ai/DeepSeek-V3-0324")[0]
    assert (v3.arch, v3.num_experts, v3.moe_top_k, v3.dense_layers, v3.router_groups, v3.router_group_topk,
            v3.mtp_layers, v3.mla.q_lora_rank, v3.mla.kv_lora_rank, v3.mla.yarn_factor) == (
        "deepseek_v3", 256, 8, (0, 1, 2), 8, 4, 1, 1536, 512, 40.0)
    assert round(parameter_count(v3) / 1e9) == 671
    assert round(forward_backward_flops(v3, 1, 0) / 6e9) == 37  # per token, forward + backward: 6 x the active ones


def test_an_unknown_model_type_is_refused_with_the_registered_ones_and_a_suggestion():
    with pytest.raises(ModelConfigError, match=r"'qwen2moe' is not supported; supported: \[.*'qwen2_moe'.*\]; "
                                               r"did you mean 'qwen2_moe'\?"):
        model_shape_from_dict({"model_type": "qwen2moe", **DENSE})


def test_glm4_moe_reads_its_router_attention_and_dense_layers():
    shape = model_shape_from_dict({"model_type": "glm4_moe", **DENSE, **GLM, "n_group": 2, "topk_group": 1,
                                   "first_k_dense_replace": 1, "routed_scaling_factor": 2.5})
    assert (shape.expert_bias, shape.router_groups, shape.router_group_topk, shape.routed_scaling_factor,
            shape.mtp_layers) == (True, 2, 1, 2.5, 0)
    assert (shape.dense_layers, shape.shared_expert_ffn_hidden_size, shape.rotary_percent) == ((0,), 32, 0.5)
    assert not shape.qkv_bias and not shape.qk_norm  # transformers' defaults: attention_bias, use_qk_norm false
    fields = model_family("glm4_moe").megatron_fields(shape)
    assert fields | {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                     "moe_router_bias_update_rate": 0.0, "moe_router_topk_scaling_factor": 2.5,
                     "moe_router_num_groups": 2, "moe_router_group_topk": 1,
                     "moe_shared_expert_gate": False} == fields


def test_deepseek_v3_reads_its_latent_attention_yarn_and_router():
    shape = model_shape_from_dict({"model_type": "deepseek_v3", **DENSE, **DEEPSEEK, "n_group": 2,
                                   "first_k_dense_replace": 1, "rope_parameters": {**YARN, "mscale": 0.8}})
    assert (shape.mla.q_head_dim, shape.mla.v_head_dim, shape.mla.yarn_factor, shape.mla.yarn_mscale,
            shape.mla.yarn_mscale_all_dim, shape.rope_scaling_factor) == (24, 16, 40.0, 0.8, 1.0, None)
    assert (shape.dense_layers, shape.router_groups, shape.routed_scaling_factor, shape.expert_bias,
            shape.shared_expert_ffn_hidden_size) == ((0,), 2, 2.5, True, 32)  # 2.5: the config class's default
    fields = model_family("deepseek_v3").megatron_fields(shape)
    assert fields | {"multi_latent_attention": True, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_head_dim": 16,
                     "qk_pos_emb_head_dim": 8, "v_head_dim": 16, "rope_type": "yarn", "rotary_scaling_factor": 40.0,
                     "original_max_position_embeddings": 4096, "mscale": 0.8, "mscale_all_dim": 1.0,
                     "qk_layernorm": True, "moe_router_score_function": "sigmoid", "moe_router_num_groups": 2,
                     "moe_router_group_topk": 1, "moe_router_topk_scaling_factor": 2.5} == fields
    plain = model_shape_from_dict({"model_type": "deepseek_v3", **DENSE, **DEEPSEEK})
    assert plain.mla.yarn_factor is None and model_family("deepseek_v3").megatron_fields(plain)["rope_type"] == "rope"
    # transformers reads mscale only beside mscale_all_dim; without it the cos/sin scale is mscale(factor, 1)
    alone = model_shape_from_dict({"model_type": "deepseek_v3", **DENSE, **DEEPSEEK,
                                   "rope_parameters": {**YARN, "mscale": 0.7, "mscale_all_dim": 0}})
    assert (alone.mla.yarn_mscale, alone.mla.yarn_mscale_all_dim) == (1.0, 0.0)


@pytest.mark.parametrize("model_type, fields, phrase", [
    ("mistral", {"sliding_window": 4096}, "mistral with sliding_window 4096"),  # Mistral-7B-v0.1's window
    ("mixtral", {"sliding_window": 4096, "num_local_experts": 4, "num_experts_per_tok": 2},
     "mixtral with sliding_window 4096"),
    ("mixtral", {"router_jitter_noise": 0.1, "num_local_experts": 4, "num_experts_per_tok": 2},
     "mixtral with router_jitter_noise 0.1"),
    ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok <= num_local_experts"),
    ("llama", {"attention_bias": True}, "biased llama projections"),
    ("qwen2_moe", {"mlp_bias": True, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 48}, "biased qwen2_moe projections"),
    ("qwen3", {"mlp_bias": True}, "biased qwen3 projections"),
    ("glm4_moe", {**GLM, "norm_topk_prob": False}, "glm4_moe with norm_topk_prob false"),
    ("glm4_moe", {**GLM, "n_group": 2, "topk_group": 2}, "n_group 2, topk_group 2 and num_experts_per_tok 2"),
    ("glm4_moe", {**GLM, "n_group": 3}, "n_group 3, topk_group 1 and 4 experts"),
    ("glm4_moe", {**GLM, "partial_rotary_factor": 0.0}, "glm4_moe with partial_rotary_factor 0.0"),
    ("glm4_moe", {**GLM, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling .*yarn"),
    ("deepseek_v3", {**DEEPSEEK, "q_lora_rank": None}, "deepseek_v3 with q_lora_rank None"),
    ("deepseek_v3", {**DEEPSEEK, "quantization_config": {"quant_method": "fp8"}},
     "deepseek_v3 with quantization_config {'quant_method': 'fp8'}"),
    ("deepseek_v3", {**DEEPSEEK, "rope_interleave": False}, "deepseek_v3 with rope_interleave False"),
    ("deepseek_v3", {**DEEPSEEK, "moe_layer_freq": 2}, "deepseek_v3 with moe_layer_freq 2"),
    ("deepseek_v3", {**DEEPSEEK, "num_key_value_heads": 2}, "deepseek_v3 with num_key_value_heads 2"),
    ("deepseek_v3", {**DEEPSEEK, "attention_bias": True}, "biased deepseek_v3 projections"),
    ("deepseek_v3", {**DEEPSEEK, "rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
     "deepseek_v3 with rope_type 'llama3'"),
    ("deepseek_v3", {**DEEPSEEK, "rope_parameters": {**YARN, "attention_factor": 1.2}},
     "deepseek_v3 with yarn attention_factor 1.2"),
    ("deepseek_v3", {**DEEPSEEK, "rope_parameters": {**YARN, "truncate": False}}, "deepseek_v3 with yarn truncate"),
    ("deepseek_v3", {**DEEPSEEK, "rope_parameters": {**YARN, "mscale": None}}, "deepseek_v3 with yarn mscale None"),
    ("deepseek_v3", {**DEEPSEEK, "rope_parameters": {**YARN, "factor": None}}, "deepseek_v3 with yarn factor None"),
    ("deepseek_v3", {**DEEPSEEK, "scoring_func": "softmax"}, "deepseek_v3 with scoring_func 'softmax'"),
    ("deepseek_v3", {**DEEPSEEK, "topk_method": "group_limited_greedy"}, "topk_method 'group_limited_greedy'"),
    ("deepseek_v3", {**DEEPSEEK, "n_group": 2, "topk_group": 2}, "n_group 2, topk_group 2"),
    ("deepseek_v3", {**DEEPSEEK, "norm_topk_prob": False}, "deepseek_v3 with norm_topk_prob false"),
])
def test_what_a_family_cannot_build_is_refused_by_name(model_type, fields, phrase):
    with pytest.raises(ModelConfigError, match=phrase):
        model_shape_from_dict({"model_type": model_type, **DENSE, **fields})


def test_qwen2_and_qwen2_moe_ignore_attention_bias_as_transformers_does_and_qwen2_moe_reads_qkv_bias():
    assert model_shape_from_dict({"model_type": "qwen2", **DENSE, "attention_bias": True}).qkv_bias
    moe = {"model_type": "qwen2_moe", **DENSE, "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}
    assert model_shape_from_dict(moe).qkv_bias and not model_shape_from_dict({**moe, "qkv_bias": False}).qkv_bias
    assert not model_shape_from_dict({**moe, "qkv_bias": False, "attention_bias": True}).qkv_bias
    assert model_shape_from_dict({"model_type": "mistral", **DENSE, "sliding_window": None}).arch == "mistral"


def test_a_family_registered_from_outside_is_read_and_planned_and_claims_nothing_twice():
    family = register_family(ModelFamily(model_type="plain_gpt", config_class="LlamaConfig", qk_norm=True,
                                         known_shapes={"plain-gpt-1b": {**DENSE, "num_key_value_heads": 2}}))
    try:
        assert model_family("plain_gpt") is family and "plain_gpt" in registered_families()
        shape = resolve_model_shape("/models/plain-gpt-1b-instruct")[0]
        assert (shape.arch, shape.qk_norm, shape.num_kv_heads) == ("plain_gpt", True, 2)
        with pytest.raises(ValueError, match="'plain_gpt' is already registered"):
            register_family(ModelFamily(model_type="plain_gpt", config_class="LlamaConfig"))
        with pytest.raises(ValueError, match=r"known shapes \['qwen3-1.7b'\] are already \['qwen3'\]'s"):
            register_family(ModelFamily(model_type="other", config_class="LlamaConfig",
                                        known_shapes={"qwen3-1.7b": DENSE}))
        assert "other" not in registered_families()
    finally:
        unregister_family("plain_gpt")
    with pytest.raises(ModelConfigError, match="'plain_gpt' is not supported"):
        model_family("plain_gpt")


def test_a_tiny_dense_checkpoint_takes_no_expert_fields(tmp_path):
    from megatron_armor.models.tiny import make_tiny_checkpoint

    with pytest.raises(ValueError, match="has no experts"):
        make_tiny_checkpoint(tmp_path, arch="mistral", moe={"num_experts": 4})
    assert not any(tmp_path.iterdir())
