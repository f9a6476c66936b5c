"""Checkpoints of a bf16 run (fp32 master weights in the optimizer) in every direction (gloo, CPU, 4 ranks): saved
with the distributed optimizer at TP=2 x DP=2, resumed at TP=1 x DP=4 and, with the plain optimizer, at TP=2 x PP=2;
that plain-optimizer run's checkpoint resumed with the distributed optimizer at TP=2 x DP=2 again. Each resumed step
is the uninterrupted run's: its rollouts bit for bit (the engines get the restored bf16 weights, which the samples'
rewards depend on), its losses within bf16's bound.

Bound (U = 2^-8, bf16's unit roundoff; tests/trainer/test_parallel_layouts.py derives the step's): at another TP the
row-parallel sums round once more per layer, so the mini-batches' logprobs move by < 2U, and so do the policy loss
(a mean of ratio-weighted advantages: |d loss| <= 2U * mean |advantage| <= 2U * the largest |advantage|, which
group-normalised rewards keep under sqrt(group size - 1) ~ 2.7) and the ratios' mean (< 2U); the grad norm within
16U relative, as each gradient entry.

That bound holds only while no token's PPO clip decision changes: a clipped token contributes no gradient, so a
token whose ratio sits near 1 - clip_low or 1 + clip_high is clipped at one layout and not at the other, and the
mini-batch's gradient changes by that token's whole share, far beyond any bf16 bound. The < 2U bound is relative
and on average; single tokens near a tie of their top logits move by far more (one of step 2's has its reference
logprob, the same weights at both layouts, 0.09 apart at TP=1 and TP=2), and the first optimizer step moves that
token's logprob by 0.16 at TP=2 and 0.29 at TP=1: at the tiny config's clip_low 0.2 its mixed ratio (advantage -2.5)
is 0.87 at TP=2 and 0.78 at TP=1, clipped at TP=1 only, and the second mini-batch's grad norm falls from 2.17 to 0.96
(with clip_low 0.3: 2.19). These runs therefore clip at 0.5 each way, which no ratio of steps 2 and 3 approaches: what
they check is the checkpoint, not PPO's clip boundary."""

import json
import math
from pathlib import Path

import pytest
from safetensors import safe_open

from launcher import run_workers
from training_runs import resume_from, run_metrics, run_overrides

CONFIG = str(Path(__file__).parents[2] / "examples" / "tiny" / "armor.yaml")
U = 2.0 ** -8
# ratios stay inside [1 - 0.5, 1 + 0.5]: no clip decision hangs on bf16 rounding (see the module docstring)
BF16 = ["model.params_dtype=bfloat16", "algorithm.clip_low=0.5", "algorithm.clip_high=0.5"]
TP2_DP2 = ["parallel.tensor_parallel_size=2", "parallel.data_parallel_size=2", "optimizer.use_distributed_optimizer=true"]
TP1_DP4 = ["parallel.tensor_parallel_size=1", "parallel.data_parallel_size=4", "optimizer.use_distributed_optimizer=true"]
TP2_PP2_PLAIN = ["parallel.tensor_parallel_size=2", "parallel.pipeline_parallel_size=2",
                 "optimizer.use_distributed_optimizer=false"]


def _run(out: Path, cache: Path, run_dir: Path, steps: int, layout: list[str], *, resume: bool) -> dict[int, dict]:
    run_workers("train_run.py", 4, out, CONFIG, *(["--resume"] if resume else []), *run_overrides(cache, run_dir, steps),
                *BF16, *layout)
    return run_metrics(run_dir)


@pytest.fixture(scope="module")
def uninterrupted(synthetic_cache, tmp_path_factory):
    """Three bf16 steps at TP=2 x DP=2 with the distributed optimizer, a checkpoint after each: the reference run."""
    run_dir = tmp_path_factory.mktemp("bf16-full") / "run"
    _run(run_dir.parent / "w", synthetic_cache, run_dir, 3, TP2_DP2, resume=False)
    return run_dir


def test_the_engines_get_bf16_weights(uninterrupted, synthetic_cache):
    """Every push of the actor's weights into the engine after an update sends them as the trainer holds them, in
    bf16: 2 bytes per parameter of the tiny model (its HF checkpoint's tensors, counted)."""
    with safe_open(synthetic_cache / "tiny-qwen2" / "model.safetensors", "pt") as checkpoint:
        params = sum(math.prod(checkpoint.get_slice(name).get_shape()) for name in checkpoint.keys())
    for step, row in run_metrics(uninterrupted).items():
        assert row["perf/weight_sync_bytes"] == 2 * params, step


def assert_resumed_step(got: dict, expected: dict) -> None:
    """`got` is `expected` (the uninterrupted run's step): its rollouts exactly, its losses within the module's bf16
    bound (another TP, PP or DP size sums in another order; a master weight that moves by a few fp32 bits moves its
    bf16 weight by a whole spacing where it crosses a rounding boundary, so not even the same TP is bitwise)."""
    assert got["train/reward_mean"] == expected["train/reward_mean"]
    keys = ("loss/policy_loss", "loss/mixed_ratio_mean", "optim/grad_norm", "mismatch/logprob_abs_diff")
    # the engine's logprobs are the same; the trainer's move by < 2U
    for key, tolerance in zip(keys, (2 * U * 2.7, 2 * U, 16 * U * expected["optim/grad_norm"], 2 * U)):
        assert got[key] == pytest.approx(expected[key], rel=0, abs=tolerance), (key, got[key], expected[key])


def test_distributed_checkpoint_resumes_at_tp1_dp4(uninterrupted, synthetic_cache, tmp_path):
    """Step 2 resumed at TP=1 x DP=4 from the TP=2 x DP=2 checkpoint (TP and DP resharded)."""
    record = json.loads((uninterrupted / "checkpoints" / "step_000001" / "trainer_state.json").read_text())
    assert record["layout"] == {"tp": 2, "pp": 1, "dp": 2}
    run_dir = tmp_path / "run"
    resume_from(uninterrupted, run_dir, 1)
    got = _run(tmp_path / "w", synthetic_cache, run_dir, 2, TP1_DP4, resume=True)
    assert_resumed_step(got[2], run_metrics(uninterrupted)[2])


def test_distributed_to_plain_at_pp2_and_back(uninterrupted, synthetic_cache, tmp_path):
    """Step 2 resumed with the plain optimizer at TP=2 x PP=2 (PP splits the layers without changing the arithmetic;
    DP 2 -> 1 sums the same micro-batches' fp32 grads); its checkpoint then resumed with the distributed optimizer at
    TP=2 x DP=2 for step 3."""
    run_dir = tmp_path / "run"
    resume_from(uninterrupted, run_dir, 1)
    got = _run(tmp_path / "w1", synthetic_cache, run_dir, 2, TP2_PP2_PLAIN, resume=True)
    expected = run_metrics(uninterrupted)
    assert_resumed_step(got[2], expected[2])
    got = _run(tmp_path / "w2", synthetic_cache, run_dir, 3, TP2_DP2, resume=True)
    assert_resumed_step(got[3], expected[3])
