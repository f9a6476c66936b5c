"""sync_weights: the engine gets every tensor, the report counts them and times the lazy gather too."""

import time

import pytest
import torch

from megatron_armor.rollout.local import LocalEngine
from megatron_armor.rollout.weight_sync import sync_weights

GATHER_S = 0.005  # a simulated gather delay per tensor


def test_sync_weights_reports_bytes_and_updates_the_engine(tiny_model_factory, monkeypatch):
    engine = LocalEngine(tiny_model_factory("qwen2"))
    monkeypatch.setattr(engine, "flush_cache", lambda: pytest.fail("update_weights leaves no stale cache"))
    new = {name: torch.randn_like(p) for name, p in engine.named_parameters_hf().items()}

    def gathered():
        for item in new.items():
            time.sleep(GATHER_S)
            yield item

    start = time.perf_counter()
    report = sync_weights(engine, gathered())
    elapsed = time.perf_counter() - start
    assert report.tensors == len(new) and report.bytes == sum(t.nbytes for t in new.values())
    assert GATHER_S * len(new) <= report.seconds <= elapsed
    assert report.metrics()["perf/weight_sync_bytes"] == report.bytes
    assert all(torch.equal(engine.named_parameters_hf()[name], t) for name, t in new.items())


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3"])
def test_moe_engine_takes_checkpoint_named_experts(tiny_model_factory, arch):
    """A Qwen3-MoE / Qwen2-MoE / Mixtral / GLM-4.5 / DeepSeek-V3 engine (transformers keeps each layer's experts fused,
    in a block it names `mlp`) names and takes its weights as the checkpoint and the trainer's push do, one tensor per
    expert projection (Mixtral's: `block_sparse_moe.experts.{e}.w1` / `w3` / `w2`); updates land in the fused tensors
    (and in Qwen2-MoE's shared expert and its gate, GLM's and DeepSeek-V3's shared experts and routers' expert-bias
    buffers, DeepSeek-V3's latent attention)."""
    from safetensors.torch import load_file

    model_dir = tiny_model_factory(arch)
    engine = LocalEngine(model_dir)
    stored = load_file(str(model_dir / "model.safetensors"))
    views = engine.named_parameters_hf()
    assert views.keys() == stored.keys() and all(torch.equal(views[name], t) for name, t in stored.items())
    new = {name: torch.randn_like(t) for name, t in stored.items() if ".experts.2." in name or ".shared_expert" in name}
    assert any(".shared_expert_gate." in name for name in new) == (arch == "qwen2_moe")
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"  # a sigmoid router's expert bias: a buffer, pushed too
    sigmoid_routed = arch in ("glm4_moe", "deepseek_v3")
    assert (bias in views) == sigmoid_routed
    new |= {bias: torch.randn_like(views[bias])} if sigmoid_routed else {}
    if arch == "deepseek_v3":  # multi-latent attention's projections and latent norms, by their checkpoint names
        new |= {name: torch.randn_like(t) for name, t in stored.items() if ".self_attn.kv_" in name}
    sync_weights(engine, iter(new.items()))
    assert all(torch.equal(engine.named_parameters_hf()[name], t) for name, t in new.items())
    fused = dict(engine.model.named_parameters())["model.layers.1.mlp.experts.gate_up_proj"]
    up = next(name for name in new if name.startswith("model.layers.1.") and name.endswith(
        ".experts.2.w3.weight" if arch == "mixtral" else ".experts.2.up_proj.weight"))
    assert torch.equal(fused[2, fused.shape[1] // 2:], new[up])
