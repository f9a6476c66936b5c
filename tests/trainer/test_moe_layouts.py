"""A Qwen3-MoE ARMOR step with its experts over EP=2 (DP=2, Megatron DDP and optimizer), or its layers over PP=2,
equals the one-process step:
logprobs, gathered HF-named gradients (experts gathered over the EP group), loss metrics and updated weights; with
a load-balancing coefficient the auxiliary loss is logged (`moe/aux_loss`) and moves the routers."""

import json
import math

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


def test_armor_train_moe_at_ep2(tiny_model_factory, tmp_path):
    """`armor train` (DP=2 x EP=2, auxiliary loss on) on an untrained tiny Qwen3-MoE, rewarded for even-length
    responses (so groups are mixed): the step logs `moe/aux_loss`, and the local engines, which got every expert
    from the trainer's push, give the trainer's logprobs."""
    from trainer.test_cli_layouts import armor_train, small_run

    model = tiny_model_factory("qwen3_moe")
    reward = tmp_path / "even_length.py"
    reward.write_text("def reward(response, row):\n    even = len(response) % 2 == 0\n    return (1.0 if even else -1.0), even\n")
    run = tmp_path / "run"
    proc = armor_train("--tp", "1", "--dp", "2", "--parallel.expert_parallel_size", "2",
                       "--reward.train_fn", f"{reward}:reward",
                       "--model.path", str(model), "--task.warm_start_steps", "0", "--model.moe_aux_loss_coeff", "0.01",
                       *small_run(tmp_path / "cache", run))
    assert proc.returncode == 0, proc.stderr[-6000:]
    step = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert step["step"] == 1 and math.isfinite(step["loss/policy_loss"]) and step["moe/aux_loss"] > 0
    assert step["mismatch/logprob_abs_diff"] < 1e-3
