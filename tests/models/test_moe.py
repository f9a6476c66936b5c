"""Qwen3-MoE, Qwen2-MoE (a gated shared expert), Mixtral, GLM-4.5 and DeepSeek-V3 (sigmoid routing, expert bias;
DeepSeek-V3's multi-latent attention) on Megatron (MoE layers; experts over EP=1 and EP=2, TP=2 with
sequence parallelism, EP=2 x TP=2, and EP=2 at expert TP 1 beside TP=2; gloo) against the HF transformers reference."""

import re
from pathlib import Path

import pytest
import torch

from launcher import concurrently, run_workers
from megatron_armor.convert.hf_to_megatron import convert_hf_to_megatron
from megatron_armor.models.hf_config import (
    ModelConfigError, check_parallel_layout, load_model_shape, model_shape_from_dict,
)
from megatron_armor.planning.memory import Layout, stage_dense_numels, stage_expert_numels

TOL = 1e-4

VARIANTS = {  # name -> (arch, make_tiny_checkpoint options)
    # 4 experts, top-2, renormalised top-k probabilities (Qwen3-30B-A3B's router), every layer MoE.
    "moe-top2-norm": ("qwen3_moe", {}),
    # Top-k probabilities as the softmax gives them; layer 0 dense (mlp_only_layers), tied embeddings.
    "moe-unnormalised-dense0": ("qwen3_moe", {"moe": {"norm_topk_prob": False, "mlp_only_layers": [0]},
                                              "tie_word_embeddings": True}),
    # Qwen2-MoE: QKV bias, unnormalised top-2, a sigmoid-gated shared expert (width 48) in every MoE layer.
    "qwen2-moe-shared-expert": ("qwen2_moe", {}),
    # Mixtral: renormalised top-2 of 4 experts of width intermediate_size (176), checkpoint names block_sparse_moe / w1-3.
    "mixtral": ("mixtral", {}),
    # GLM-4.5: layer 0 dense, sigmoid top-2 of 4 with a (random) expert bias, scaled by 2.5, an ungated shared expert;
    # q/k/v biases, q/k norms, RoPE on half of each head's dims.
    "glm4-moe": ("glm4_moe", {}),
    # DeepSeek-V3: multi-latent attention (q/kv latents split over TP, YaRN RoPE with both mscales), layer 0 dense,
    # sigmoid top-2 of 4 in 2 groups (the best 1 kept) with a (random) expert bias, scaled by 2.5, a shared expert.
    "deepseek-v3": ("deepseek_v3", {}),
}


def test_moe_shape_from_config(tiny_model_factory):
    shape = load_model_shape(tiny_model_factory("qwen3_moe", num_layers=4, moe={"decoder_sparse_step": 2}))
    assert (shape.num_experts, shape.moe_top_k, shape.moe_ffn_hidden_size, shape.norm_topk_prob) == (4, 2, 32, True)
    assert shape.dense_layers == (0, 2) and shape.qk_norm
    assert [shape.is_moe_layer(layer) for layer in range(4)] == [False, True, False, True]
    qwen2 = load_model_shape(tiny_model_factory("qwen2_moe"))
    assert (qwen2.num_experts, qwen2.norm_topk_prob, qwen2.shared_expert_ffn_hidden_size) == (4, False, 48)
    assert qwen2.qkv_bias and not qwen2.qk_norm and shape.shared_expert_ffn_hidden_size == 0
    qwen2_config = {"model_type": "qwen2_moe", "num_attention_heads": 4, "hidden_size": 64, "num_hidden_layers": 2,
                    "vocab_size": 128, "intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32}
    with pytest.raises(ModelConfigError, match="shared_expert_intermediate_size"):
        model_shape_from_dict(qwen2_config)
    with pytest.raises(ModelConfigError, match="shared_expert_intermediate_size=50 is not divisible by tensor"):
        check_parallel_layout(model_shape_from_dict({**qwen2_config, "shared_expert_intermediate_size": 50}), 4, 1)
    with pytest.raises(ModelConfigError, match="num_experts_per_tok"):
        model_shape_from_dict({"model_type": "qwen3_moe", "num_attention_heads": 4, "hidden_size": 64,
                               "num_hidden_layers": 2, "vocab_size": 128, "intermediate_size": 64,
                               "num_experts": 4, "num_experts_per_tok": 5, "moe_intermediate_size": 32})


# process count -> the layouts ("tp<T>ep<E>[etp<X>]") its one launch runs; TP > 1 with sequence parallelism, expert TP
# X (default TP). tp2ep2etp1: TP=2 x DP=1 for attention, the same 2 ranks as EP=2 x expert TP 1 for the experts.
LAYOUTS = {1: ["tp1ep1"], 2: ["tp1ep2", "tp2ep1", "tp2ep2etp1"], 4: ["tp2ep2"]}


def test_moe_matches_hf_and_layouts_match_one_process(tiny_model_factory, tmp_path):
    """Forward vs HF and exports at EP=1, EP=2, TP=2 (sequence parallel), EP=2 x TP=2 and EP=2 at expert TP 1 with TP=2;
    every layout's logprobs (of its data-parallel rank's rows) and gathered gradients equal the one-process ones, the
    exports that are views of the parameters are those `parameters_exported_as_views` names, the planner's parameters
    per rank (the experts and the rest) and expert data-parallel size are the model's, and Megatron checkpoints written
    at EP=2 and (Qwen2-MoE, DeepSeek-V3) at TP=2 x EP=2 load at every layout (resharded across TP, EP and expert TP) bit
    for bit."""
    model_dirs = [str(tiny_model_factory(arch, **options)) for arch, options in VARIANTS.values()]
    saved = {0: ("megatron-ep2", 1), 2: ("megatron-tp2-ep2", 2), 5: ("megatron-v3-tp2-ep2", 2)}  # index: (dir, tp)
    # saved at EP=2, Qwen2-MoE's (a shared expert split over TP) and DeepSeek-V3's (latent attention split over TP) at
    # TP=2 x EP=2, all at once
    checkpoints = dict(zip((model_dirs[i] for i in saved), concurrently(*(
        lambda i=i, out=out, tp=tp: convert_hf_to_megatron(model_dirs[i], tmp_path / out, tp=tp, pp=1, ep=2)
        for i, (out, tp) in saved.items()))))

    def launch(nproc: int) -> list[dict]:
        return run_workers("moe_parity.py", nproc, tmp_path / f"n{nproc}", ",".join(LAYOUTS[nproc]),
                           ",".join(f"{model}={megatron}" for model, megatron in checkpoints.items()), *model_dirs)

    launched = dict(zip((1, 2), concurrently(lambda: launch(1), lambda: launch(2))))  # one rank beside two
    launched[4] = launch(4)
    results = {(layout, f"n{nproc}"): [rank[layout] for rank in ranks]
               for nproc, ranks in launched.items() for layout in LAYOUTS[nproc]}
    assert all(rank["resharded_equal"] == dict.fromkeys(checkpoints, True)
               for ranks in results.values() for rank in ranks)
    for variant, model_dir in zip(VARIANTS, model_dirs):
        name, shape = Path(model_dir).name, load_model_shape(model_dir)
        one = torch.load(tmp_path / "n1" / "tp1ep1" / name / "rank0.pt")
        for (layout, launch), ranks in results.items():
            tp, ep, etp = layout_sizes(layout)
            for rank, result in enumerate(rank[model_dir] for rank in ranks):
                assert result["forward_diff"] < TOL, (variant, layout, result["forward_diff"])
                assert result["export_keys_match"] and result["export_equal"], (variant, layout)
                assert result["views_match"], (variant, layout)
                assert result["local_experts"] == 4 // ep and result["expert_split"] == etp, (variant, layout)
                dp_rank, dp = result["dp"]
                planned = Layout(tp=tp, dp=dp, ep=ep, etp=etp)  # the planner's expert parameters and groups
                assert result["expert_numels"] == sum(stage_expert_numels(shape, planned.expert_tp, 1, 0, ep))
                assert result["dense_numels"] == sorted(stage_dense_numels(shape, tp, 1, 0)), (variant, layout)
                assert result["expert_dp"] == planned.expert_dp, (variant, layout)
                saved = torch.load(tmp_path / launch / layout / name / f"rank{rank}.pt")
                assert torch.allclose(saved["logprobs"], one["logprobs"][dp_rank::dp], atol=1e-5), (variant, layout)
                assert saved["grads"].keys() == one["grads"].keys(), (variant, layout)
                for key, grad in one["grads"].items():
                    assert torch.allclose(saved["grads"][key], grad, atol=grad_atol(grad)), (variant, layout, key)


def layout_sizes(layout: str) -> tuple[int, int, int]:
    """"tp<T>ep<E>[etp<X>]" -> (T, E, X), X defaulting to T (Megatron's expert TP)."""
    tp, ep, etp = re.fullmatch(r"tp(\d+)ep(\d+)(?:etp(\d+))?", layout).groups()
    return int(tp), int(ep), int(etp or tp)


def grad_atol(grad: torch.Tensor) -> float:
    """fp32 gradients summed in another order (over TP shards, sequence slices): their errors scale with the tensor's
    largest entries (the embedding's reach thousands behind the RMSNorm of its small weights)."""
    return max(1e-5, 1e-6 * grad.abs().max().item())
