"""`scripts/gpu_checks.sh train` (benchmarks/train_check.py), prepared for a GPU session: the script parses, and its
CPU dry run (`train --dry-run`: the tests' tiny model, bf16, distributed optimizer, fused head, the in-process engine)
trains, checkpoints, resumes and writes every figure of its JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
SCRIPT = REPO / "scripts" / "gpu_checks.sh"


def test_gpu_checks_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_train_dry_run_writes_every_figure(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(SCRIPT), "train", "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((tmp_path / "train_check.json").read_text())
    assert report["device"] == "cpu (dry run)" and report["steps"] == 4
    assert report["model_params"] == 109120  # the tiny model: embedding, 2 layers, untied head (planning/memory.py)
    for figure in ("step_seconds", "tokens_per_second", "tflops_per_gpu"):
        assert 0 < report[figure]["min"] <= report[figure]["median"] <= report[figure]["max"], figure
    # the trainer's FLOPs count the real lengths, the plan's every sequence at its max length: never more than that
    assert 0 < report["tflops_per_gpu"]["median"] <= report["plan_tflops"]
    assert report["peak_memory_bytes"] is None and report["plan_training_peak_bytes"] > 0  # no CUDA allocator here
    # engine and trainer both hold the bf16 weights but compute with other kernels: a few bf16 roundings (U = 2^-8)
    assert 0 < report["logprob_mismatch"]["median"] <= report["logprob_mismatch"]["max"] < 2 ** -6
    # the resumed steps at the same layout: the same arithmetic, bit for bit
    assert report["resume"] == {"step": 3, "reward_equal": True, "policy_loss_diff": 0.0, "grad_norm_rel_diff": 0.0}
