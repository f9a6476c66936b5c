"""Qwen3-MoE on Megatron (MoE layers, experts over EP=1 and EP=2, gloo) against the HF transformers reference."""

from pathlib import Path

import pytest
import torch

from launcher import run_workers
from megatron_armor.models.hf_config import ModelConfigError, load_model_shape, model_shape_from_dict

TOL = 1e-4

VARIANTS = {
    # 4 experts, top-2, renormalised top-k probabilities (Qwen3-30B-A3B's router), every layer MoE.
    "moe-top2-norm": {},
    # Top-k probabilities as the softmax gives them; layer 0 dense (mlp_only_layers), tied embeddings.
    "moe-unnormalised-dense0": {"moe": {"norm_topk_prob": False, "mlp_only_layers": [0]}, "tie_word_embeddings": True},
}


def test_moe_shape_from_config(tiny_model_factory):
    shape = load_model_shape(tiny_model_factory("qwen3_moe", num_layers=4, moe={"decoder_sparse_step": 2}))
    assert (shape.num_experts, shape.moe_top_k, shape.moe_ffn_hidden_size, shape.norm_topk_prob) == (4, 2, 32, True)
    assert shape.dense_layers == (0, 2) and shape.qk_norm
    assert [shape.is_moe_layer(layer) for layer in range(4)] == [False, True, False, True]
    with pytest.raises(ModelConfigError, match="num_experts_per_tok"):
        model_shape_from_dict({"model_type": "qwen3_moe", "num_attention_heads": 4, "hidden_size": 64,
                               "num_hidden_layers": 2, "vocab_size": 128, "intermediate_size": 64,
                               "num_experts": 4, "num_experts_per_tok": 5, "moe_intermediate_size": 32})


def test_moe_matches_hf_and_ep2_matches_ep1(tiny_model_factory, tmp_path):
    """Forward vs HF and exports at EP=1 and EP=2; EP=2 logprobs and gathered gradients equal EP=1's."""
    model_dirs = [str(tiny_model_factory("qwen3_moe", **options)) for options in VARIANTS.values()]
    ep1 = run_workers("moe_parity.py", 1, tmp_path / "ep1", *model_dirs)
    ep2 = run_workers("moe_parity.py", 2, tmp_path / "ep2", *model_dirs)
    for variant, model_dir in zip(VARIANTS, model_dirs):
        for ep, results in ((1, ep1), (2, ep2)):
            for result in (rank[model_dir] for rank in results):
                assert result["forward_diff"] < TOL, (variant, ep, result["forward_diff"])
                assert result["export_keys_match"] and result["export_equal"], (variant, ep)
                assert result["local_experts"] == 4 // ep, (variant, ep)
        name = Path(model_dir).name
        one = torch.load(tmp_path / "ep1" / name / "rank0.pt")
        two = [torch.load(tmp_path / "ep2" / name / f"rank{r}.pt") for r in range(2)]
        assert torch.allclose(torch.cat([two[0]["logprobs"], two[1]["logprobs"]])[[0, 2, 1, 3]], one["logprobs"],
                              atol=1e-5), variant
        for rank in two:
            assert rank["grads"].keys() == one["grads"].keys(), variant
            for key, grad in one["grads"].items():
                assert torch.allclose(rank["grads"][key], grad, atol=1e-5), (variant, key)
