"""A Qwen3-MoE ARMOR step with its experts over EP=2 (DP=2, Megatron DDP and optimizer), or its layers over PP=2,
equals the one-process step:
logprobs, gathered HF-named gradients (experts gathered over the EP group), loss metrics and updated weights; with
a load-balancing coefficient the auxiliary loss is logged (`moe/aux_loss`) and moves the routers."""

import torch

from launcher import run_workers
from trainer.test_parallel_layouts import assert_same_step


def test_moe_ep2_step_matches_single_rank(tmp_path):
    from megatron_armor.models.tiny import make_tiny_checkpoint

    actor, ref = (make_tiny_checkpoint(tmp_path / name, arch="qwen3_moe", seed=seed)
                  for name, seed in (("actor", 0), ("ref", 1)))
    run_workers("layout_parity.py", 1, tmp_path / "n1", f"moe-base,{actor},{ref},1,1,torch",
                f"moe-aux,{actor},{ref},1,1,torch,aux=0.1")
    run_workers("layout_parity.py", 2, tmp_path / "n2", f"moe-ep2,{actor},{ref},1,1,torch,ep=2",
                f"moe-pp2,{actor},{ref},1,2,torch")
    base = torch.load(tmp_path / "n1" / "moe-base" / "rank0.pt")
    ranks = [torch.load(tmp_path / "n2" / "moe-ep2" / f"rank{r}.pt") for r in range(2)]
    assert any(".mlp.experts.3.down_proj" in name for name in base["grads"])
    assert ranks[0]["layout"] == (1, 1, 2)
    assert_same_step(ranks, base)
    assert_same_step([torch.load(tmp_path / "n2" / "moe-pp2" / f"rank{r}.pt") for r in range(2)], base)

    aux = torch.load(tmp_path / "n1" / "moe-aux" / "rank0.pt")
    assert "moe/aux_loss" not in base["metrics"] and 0.5 < aux["metrics"]["moe/aux_loss"] < 2.5, aux["metrics"]
    router = "model.layers.1.mlp.gate.weight"
    assert not torch.equal(aux["grads"][router], base["grads"][router])
    attention = "model.layers.1.self_attn.o_proj.weight"  # through the router's input into the layers below it
    assert not torch.equal(aux["grads"][attention], base["grads"][attention])
