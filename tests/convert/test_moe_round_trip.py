"""Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5 and DeepSeek-V3 HF -> Megatron (experts written by EP=1 or EP=2 ranks, by EP=2
ranks whole beside TP=2 (expert TP 1), beside TP=2 with a shared expert, or saved at PP=2) -> HF (exported by one
process, or one per pipeline stage) round trips are bitwise."""

import pytest
from safetensors.torch import load_file

from megatron_armor.convert.hf_export import convert_megatron_to_hf
from megatron_armor.convert.hf_to_megatron import convert_hf_to_megatron
from megatron_armor.convert.weights import HFCheckpointReader

# case -> (arch, make_tiny_checkpoint options, layout to save at as convert_hf_to_megatron's tp / pp / ep / etp, pp to
# export with)
CASES = {
    "every-layer-moe-ep1": ("qwen3_moe", {}, {}, 1),
    "every-layer-moe-ep2": ("qwen3_moe", {}, {"ep": 2}, 2),
    # Layer 0 dense: Megatron keeps each layer's tensors under their own keys (no layer axis); tied embeddings. Two
    # writers: TP=2 for the dense weights, the same two ranks as EP=2 with every expert whole (expert TP 1).
    "dense0-tied-tp2-ep2-etp1": ("qwen3_moe", {"moe": {"mlp_only_layers": [0]}, "tie_word_embeddings": True},
                                 {"tp": 2, "ep": 2, "etp": 1}, 1),
    "dense0-pp2": ("qwen3_moe", {"moe": {"mlp_only_layers": [0]}}, {"pp": 2}, 2),
    # Qwen2-MoE: QKV biases and a gated shared expert, split over TP=2 beside EP=2.
    "qwen2-moe-shared-expert-tp2-ep2": ("qwen2_moe", {}, {"tp": 2, "ep": 2}, 1),
    # Mixtral: its checkpoint's names (block_sparse_moe, w1 / w3 / w2), saved at TP=2 x EP=2, exported over PP=2.
    "mixtral-tp2-ep2": ("mixtral", {}, {"tp": 2, "ep": 2}, 2),
    # GLM-4.5: the routers' expert-bias buffers, QKV biases, q/k norms and an ungated shared expert, written by TP=2
    # ranks that are EP=2 at expert TP 1, exported over PP=2.
    "glm4-moe-tp2-ep2-etp1": ("glm4_moe", {}, {"tp": 2, "ep": 2, "etp": 1}, 2),
}


@pytest.mark.parametrize("case", CASES)
def test_moe_round_trip_is_bitwise(case, tiny_model_factory, tmp_path):
    arch, options, layout, export_pp = CASES[case]
    hf_dir = tiny_model_factory(arch, **options)
    megatron = convert_hf_to_megatron(hf_dir, tmp_path / "megatron", **{"tp": 1, "pp": 1, **layout})
    back = convert_megatron_to_hf(megatron, tmp_path / "hf", pp=export_pp)
    original = load_file(str(hf_dir / "model.safetensors"))
    exported = {name: tensor for file in back.glob("*.safetensors") for name, tensor in load_file(str(file)).items()}
    reader = HFCheckpointReader(hf_dir)
    tied = options.get("tie_word_embeddings", False)  # a tied checkpoint's stored lm_head copy is not exported
    expected = {name: original[name] for name in reader.names() if not (tied and name == "lm_head.weight")}
    assert exported.keys() == expected.keys()
    assert all(exported[name].equal(tensor) for name, tensor in expected.items())


# A few tensors of a multi-token-prediction layer (layer 2 of a 2-layer model) under each family's checkpoint names.
MTP_TENSORS = {
    "glm4_moe": {"model.layers.2.eh_proj.weight": (64, 128), "model.layers.2.enorm.weight": (64,)},
    "deepseek_v3": {"model.layers.2.eh_proj.weight": (64, 128), "model.layers.2.hnorm.weight": (64,),
                    "model.layers.2.self_attn.kv_a_proj_with_mqa.weight": (40, 64),
                    "model.layers.2.shared_head.head.weight": (128, 64)},
}


@pytest.mark.parametrize("arch", MTP_TENSORS)
def test_a_bf16_checkpoint_keeps_its_fp32_expert_bias_and_carries_its_mtp_layer_bit_for_bit(arch, tiny_model_factory,
                                                                                            tmp_path):
    """transformers keeps GLM's and DeepSeek-V3's routers' expert bias in fp32 beside bf16 weights (as the released
    checkpoints store it): conversion accepts the mix, Megatron keeps the bias in fp32, and the round trip (written by
    TP=2 ranks that are EP=2, exported over PP=2: DeepSeek-V3's multi-latent attention split over TP, its dense first
    layer, sigmoid router and shared expert) returns every tensor in its own dtype, bit for bit. The checkpoint's
    multi-token-prediction layer (`num_nextn_predict_layers` 1: tensors of layer 2 of 2, which neither model builds)
    is carried through both conversions verbatim."""
    import json
    import shutil

    import torch
    from safetensors.torch import save_file

    source = tiny_model_factory(arch)
    hf_dir = tmp_path / "bf16-mtp"
    shutil.copytree(source, hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    original = {name: t if name.endswith("e_score_correction_bias") else t.to(torch.bfloat16)
                for name, t in load_file(str(source / "model.safetensors")).items()}
    generator = torch.Generator().manual_seed(0)
    mtp = {name: torch.randn(size, generator=generator).to(torch.bfloat16) for name, size in MTP_TENSORS[arch].items()}
    mtp["model.layers.2.mlp.gate.e_score_correction_bias"] = torch.randn(4, generator=generator)
    original |= mtp
    save_file(original, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    megatron = convert_hf_to_megatron(hf_dir, tmp_path / "megatron", tp=2, pp=1, ep=2)
    assert set(load_file(str(megatron / "carried" / "model.safetensors"))) == set(mtp)
    back = convert_megatron_to_hf(megatron, tmp_path / "hf", pp=2)
    exported = {name: tensor for file in back.glob("*.safetensors") for name, tensor in load_file(str(file)).items()}
    assert {t.dtype for name, t in exported.items() if "e_score_correction_bias" in name} == {torch.float32}
    assert exported.keys() == original.keys()
    assert all(exported[name].dtype == t.dtype and exported[name].equal(t) for name, t in original.items())
