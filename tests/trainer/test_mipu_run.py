"""MIPU through the trainer with TP=2 on 2 gloo processes and a simulated-FP8 engine: the Step-1 loss,
the gate's decisions, bit-exact rollback of actor, optimizer and engine (with the trainer offloaded
between its phases, as colocated runs do; and in rollout.mode one_step_off, with a rollout queued across the
rollback), and a full `armor train` run."""

import json
import math
from pathlib import Path

import pytest
from launcher import run_workers

CONFIG = str(Path(__file__).parents[2] / "examples" / "tiny" / "mipu.yaml")


def _overrides(cache_dir: Path, run_dir: Path) -> list[str]:
    return [
        f"task.cache_dir={cache_dir}", f"logging.run_dir={run_dir}", "task.num_train_rows=400", "task.num_val_rows=16",
        "train.train_batch_size=4", "train.gen_batch_size=8", "train.mini_batch_size=2", "mipu.gate_prompts=4",
        "mipu.gate_n=4", "eval.every=0", "eval.before_train=false", "logging.tensorboard=false",
        "logging.plot=false", "algorithm.clip_high=null", "algorithm.dual_clip=null",  # mipu's defaults
    ]


MODES = {  # rollout mode -> its overrides
    "sync": ["train.max_steps=2", "rollout.memory.offload_trainer=true"],
    "one_step_off": ["train.max_steps=3", "rollout.mode=one_step_off"],
    "async": ["train.max_steps=3", "rollout.mode=async", "rollout.max_staleness=1"],
}


@pytest.mark.parametrize("mode", MODES)
def test_forced_reject_restores_actor_optimizer_and_engine_bit_for_bit(synthetic_cache, tmp_path, mode):
    """Steps: forced accept, forced reject (one_step_off and async: and a third step, accepted).

    sync, with rollout.memory.offload_trainer on: the rollback snapshot lives on the host and the restore runs in a
    training phase; the rollouts run with the actor's weights parked, the gate's with them resident.
    one_step_off: step 2's rollout, generated during step 1 from the weights before its update, stays queued
    through the rollback that restores those weights, and step 2 trains on it on-policy: staleness 0, since a
    rollback does not advance the weight version.
    async: every generation batch starts from kept weights (the initial ones or an accepted step's; bit for bit),
    never the rejected candidate's, which the gate scores while the generator is stopped."""
    ranks = run_workers("mipu_rollback.py", 2, tmp_path / "w", CONFIG, *_overrides(synthetic_cache, tmp_path / "run"),
                        *MODES[mode])
    for result in ranks:
        accepted, rejected = result["metrics"][:2]
        assert accepted["mipu/accepted"] == 1.0 and accepted["mipu/rollbacks"] == 0.0
        assert rejected["mipu/accepted"] == 0.0 and rejected["mipu/rollbacks"] == 1.0
        assert result["accept_changed"] == [True, True, True]  # weights, Adam state, engine all moved
        assert result["reject_restored"] == [True, True, True]
        assert result["loss_clip"] == [0.2, 0.2, 1.4]  # mipu.md §2: symmetric eps 0.2, dual bound 1 + 2 eps
        for metrics in result["metrics"]:
            for key in ("mipu/gap_proxy", "mismatch/k3", "loss/is_weight_mean", "loss/is_truncated_fraction",
                        "loss/policy_loss", "optim/grad_norm"):
                assert math.isfinite(metrics[key]), (key, metrics)
            # the fp8 engine: far above the fp32 floor (~1e-7); its size depends on the samples, so on the CPU
            assert metrics["mismatch/k3"] > 0 and metrics["mismatch/logprob_abs_diff"] > 1e-4
        if mode == "sync":
            assert result["optimizer_steps"] == [2, 2] and result["versions"] == [1, 1]
            assert result["rollouts"] == [[0, "MainThread", False], [1, "MainThread", True]]
            parked = [[True] * int(m["train/num_gen_batches"]) + [False] for m in (accepted, rejected)]
            assert result["weights_parked_at_generate"] == parked[0] + parked[1]  # each step: rollouts, then the gate
            assert rejected["memory/trainer_parked_gib"] > 0 and rejected["perf/trainer_offload_seconds"] > 0
        elif mode == "async":  # the generator never samples from the rejected candidate: it is stopped at pushes
            assert result["optimizer_steps"] == [2, 2, 4] and result["versions"] == [1, 1, 2]
            assert result["batch_weights"] and all(kept is not None for kept in result["batch_weights"])
            assert all(m["async/staleness_max"] <= 1 for m in result["metrics"])
            assert result["metrics"][2]["mipu/accepted"] == 1.0 and result["metrics"][2]["mipu/rollbacks"] == 1.0
        else:  # the rollback keeps the version: step 2's queued rollout (engine = restored weights) has staleness 0
            assert result["optimizer_steps"] == [2, 2, 4] and result["versions"] == [1, 1, 2]
            assert result["rollouts"] == [[0, "MainThread", False], [1, "rollout-step-1", False],
                                          [2, "rollout-step-2", True]]  # kept, not regenerated
            assert [m["async/staleness_mean"] for m in result["metrics"]] == [0.0, 1.0, 0.0]
            assert result["metrics"][2]["mipu/accepted"] == 1.0 and result["metrics"][2]["mipu/rollbacks"] == 1.0
    assert ranks[0]["metrics"][1]["mipu/gap_proxy"] == ranks[1]["metrics"][1]["mipu/gap_proxy"]


def test_mipu_tp2_run_logs_gate_decisions(synthetic_cache, tmp_path):
    run_dir = tmp_path / "run"
    run_workers("train_run.py", 2, tmp_path / "w", CONFIG, *_overrides(synthetic_cache, run_dir), "train.max_steps=2",
                "checkpoint.every=2",
                "rollout.memory.offload_trainer=true")  # the checkpoint is saved from a parked trainer
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in ("mipu/gap_proxy", "mipu/rollbacks", "mismatch/k3", "train/reward_mean",
                    "loss/kl_to_ref", "memory/trainer_parked_gib"):  # the 1e-3 k3 KL-to-reference term of mipu.md §2 is on
            assert math.isfinite(row[key]), (key, row)
        t = row["step"] - 1  # the RL step the row logs, from 0
        c_t = 4e-3 + min(t, 100) / 100 * (1e-3 - 4e-3)  # mipu.md §3 with examples/tiny/mipu.yaml's schedule
        assert row["mipu/tolerance"] == pytest.approx(c_t, rel=1e-12)
        assert row["mipu/accepted"] == float(row["mipu/gap_proxy"] >= -c_t)  # accept iff T_post >= -c_t
    assert rows[-1]["mipu/rollbacks"] == sum(1 - r["mipu/accepted"] for r in rows)
    state = json.loads((run_dir / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["extra"]["mipu_gate"]["rollbacks"] == rows[-1]["mipu/rollbacks"]
