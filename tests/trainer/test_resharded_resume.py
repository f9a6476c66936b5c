"""Distributed checkpoints of the full training state (gloo, CPU): a checkpoint saved at TP=2 resumes at
TP=1 x DP=2 (distributed optimizer) and one saved at PP=2 at PP=1 x DP=2, each giving the next step of the
uninterrupted TP=2 run, and so does one saved at CP=2 (context parallelism) at CP=1 x DP=2; a run killed with SIGKILL in the middle of a save keeps its previous checkpoint,
and `--resume` continues from it to the same step as the uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from launcher import WORKERS, run_workers
from training_runs import resume_from, run_metrics, run_overrides
from megatron_armor.utils.net import free_port

CONFIG = str(Path(__file__).parents[2] / "examples" / "tiny" / "armor.yaml")
# The step's numbers under another layout: fp32 sums in another order (the layout tests' tolerance).
LOSS_KEYS = ("loss/policy_loss", "loss/clip_fraction", "loss/mixed_ratio_mean", "optim/grad_norm", "train/reward_mean")
TP1_DP2 = ["parallel.tensor_parallel_size=1", "parallel.data_parallel_size=2"]
PP2 = ["parallel.tensor_parallel_size=1", "parallel.pipeline_parallel_size=2"]
CP2 = ["parallel.tensor_parallel_size=1", "parallel.context_parallel_size=2"]


def assert_same_step(got: dict, expected: dict) -> None:
    for key in LOSS_KEYS:
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key


@pytest.fixture(scope="module")
def uninterrupted(synthetic_cache, tmp_path_factory):
    """Two steps at TP=2 with a checkpoint after each (asynchronous saves): the reference run."""
    run_dir = tmp_path_factory.mktemp("full") / "run"
    run_workers("train_run.py", 2, run_dir.parent / "w", CONFIG, *run_overrides(synthetic_cache, run_dir, 2),
                "checkpoint.async_save=true")
    return run_dir


def test_tp2_checkpoint_resumes_at_tp1_dp2(uninterrupted, synthetic_cache, tmp_path):
    """Saved at TP=2 x DP=1 (plain optimizer), resumed at TP=1 x DP=2 (distributed optimizer on by default)."""
    checkpoint = uninterrupted / "checkpoints" / "step_000001"
    record = json.loads((checkpoint / "trainer_state.json").read_text())
    assert record["layout"] == {"tp": 2, "pp": 1, "dp": 1} and record["modules"] == ["actor", "optimizer"]
    assert sorted(p.name for p in (checkpoint / "state").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    run_dir = tmp_path / "run"
    resume_from(uninterrupted, run_dir, 1)
    run_workers("train_run.py", 2, tmp_path / "w", CONFIG, "--resume", *run_overrides(synthetic_cache, run_dir, 2), *TP1_DP2)
    assert_same_step(run_metrics(run_dir)[2], run_metrics(uninterrupted)[2])
    assert "RNG states are per rank and do not reshard" in (tmp_path / "w" / "stderr.txt").read_text()
    resaved = json.loads((run_dir / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert resaved["layout"] == {"tp": 1, "pp": 1, "dp": 2}


def test_pp2_checkpoint_resumes_at_pp1(uninterrupted, synthetic_cache, tmp_path):
    """Step 1 at PP=2, step 2 resumed at PP=1 x DP=2: step 2 is the uninterrupted TP=2 run's."""
    run_dir = tmp_path / "run"
    run_workers("train_run.py", 2, tmp_path / "w1", CONFIG, *run_overrides(synthetic_cache, run_dir, 1), *PP2)
    assert_same_step(run_metrics(run_dir)[1], run_metrics(uninterrupted)[1])
    run_workers("train_run.py", 2, tmp_path / "w2", CONFIG, "--resume", *run_overrides(synthetic_cache, run_dir, 2), *TP1_DP2)
    assert_same_step(run_metrics(run_dir)[2], run_metrics(uninterrupted)[2])


def test_cp2_checkpoint_resumes_at_cp1(uninterrupted, synthetic_cache, tmp_path):
    """Step 1 at CP=2 (each sequence's zig-zag chunks over two ranks, one data-parallel replica), step 2 resumed at
    CP=1 x DP=2: both steps are the uninterrupted TP=2 run's."""
    run_dir = tmp_path / "run"
    run_workers("train_run.py", 2, tmp_path / "w1", CONFIG, *run_overrides(synthetic_cache, run_dir, 1), *CP2)
    assert_same_step(run_metrics(run_dir)[1], run_metrics(uninterrupted)[1])
    record = json.loads((run_dir / "checkpoints" / "step_000001" / "trainer_state.json").read_text())
    assert record["layout"] == {"tp": 1, "pp": 1, "dp": 1, "cp": 2}
    run_workers("train_run.py", 2, tmp_path / "w2", CONFIG, "--resume", *run_overrides(synthetic_cache, run_dir, 2), *TP1_DP2)
    assert_same_step(run_metrics(run_dir)[2], run_metrics(uninterrupted)[2])
    assert "saved at tp 1 x pp 1 x dp 1 x cp 2, resumed at tp 1 x pp 1 x dp 2" in (tmp_path / "w2" / "stderr.txt").read_text()


def test_sigkill_mid_save_keeps_the_previous_checkpoint(uninterrupted, synthetic_cache, tmp_path):
    """Every rank stops after writing its shards of step 2 (ARMOR_CHECKPOINT_STALL_AT_STEP) and the job is
    killed with SIGKILL: step 1 stays the latest complete checkpoint, and --resume redoes step 2 from it."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           str(WORKERS / "train_run.py"), str(tmp_path / "w1"), CONFIG, *run_overrides(synthetic_cache, run_dir, 2)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ARMOR_CHECKPOINT_STALL_AT_STEP": "2"}
    (tmp_path / "w1").mkdir()
    with open(tmp_path / "w1" / "stderr.txt", "w") as log:
        job = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, start_new_session=True)
        partial = run_dir / "checkpoints" / ".tmp_step_000002" / "state"
        deadline = time.monotonic() + 600
        while len(list(partial.glob("*.distcp"))) < 2 and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        processes = [*psutil.Process(job.pid).children(recursive=True), psutil.Process(job.pid)]
        for process in processes:  # torchrun and its ranks (which torchrun starts in sessions of their own)
            process.send_signal(signal.SIGKILL)
        job.wait()
        psutil.wait_procs(processes, timeout=30)
    assert len(list(partial.glob("*.distcp"))) == 2, (tmp_path / "w1" / "stderr.txt").read_text()[-4000:]
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [".tmp_step_000002", "step_000001"]
    assert (checkpoints / "step_000001" / "COMPLETE").is_file()
    run_workers("train_run.py", 2, tmp_path / "w2", CONFIG, "--resume", *run_overrides(synthetic_cache, run_dir, 2))
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000001", "step_000002"]
    assert_same_step(run_metrics(run_dir)[2], run_metrics(uninterrupted)[2])
