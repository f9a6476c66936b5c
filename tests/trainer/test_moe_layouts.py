"""`armor train` on a tiny Qwen3-MoE and a tiny Qwen2-MoE with their experts over EP=2. The EP=2 and PP=2 layout
steps against one process run with the other layouts' in one launch: tests/trainer/test_parallel_layouts.py (moe-*
and qwen2-moe-* jobs)."""

import json
import math

import pytest


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_armor_train_moe_at_ep2(tiny_model_factory, tmp_path, arch):
    """`armor train` (DP=2 x EP=2, auxiliary loss on, routing replay of the rollouts' routes: train.routing_replay
    rollout) on an untrained tiny Qwen3-MoE or Qwen2-MoE (a gated shared expert), rewarded for even-length responses (so
    groups are mixed), 2 steps: each logs `moe/aux_loss` and `moe/routing_agreement`, and the local engines, which
    recorded their routes, give the trainer's logprobs; at step 2 they sample with the weights step 1's push gave them,
    gathered over the EP ranks (a misplaced expert, or a missed push at lr 1e-3, would move the logprobs far above the
    bound)."""
    from trainer.test_cli_layouts import armor_train, small_run

    model = tiny_model_factory(arch)
    reward = tmp_path / "even_length.py"
    reward.write_text("def reward(response, row):\n    even = len(response) % 2 == 0\n    return (1.0 if even else -1.0), even\n")
    run = tmp_path / "run"
    proc = armor_train("--tp", "1", "--dp", "2", "--parallel.expert_parallel_size", "2",
                       "--reward.train_fn", f"{reward}:reward",
                       "--model.path", str(model), "--task.warm_start.steps", "0", "--model.moe_aux_loss_coeff", "0.01",
                       "--train.routing_replay", "rollout", "--optimizer.lr", "1e-3", "--optimizer.warmup_steps", "0",
                       *small_run(tmp_path / "cache", run), "--max-steps", "2")
    assert proc.returncode == 0, proc.stderr[-6000:]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-2:]
    assert [step["step"] for step in steps] == [1, 2]
    for step in steps:
        assert math.isfinite(step["loss/policy_loss"]) and step["moe/aux_loss"] > 0
        assert step["mismatch/logprob_abs_diff"] < 1e-5  # fp32 engines: ~1e-7 measured
        # R3: the engines' fp32 routers chose what the trainer's would (it replays their routes), and the replayed
        # routes lined up with the tokens (a shifted route would move the logprobs, above)
        assert step["moe/routing_agreement"] > 0.99 and step["moe/expert_load_cv"] > 0
