"""Helpers of the tests that run `armor train` and resume it from a checkpoint (tests/workers/train_run.py)."""

import json
import shutil
from pathlib import Path


def run_overrides(cache_dir: Path, run_dir: Path, steps: int) -> list[str]:
    return [f"task.cache_dir={cache_dir}", f"logging.run_dir={run_dir}", f"train.max_steps={steps}",
            "task.num_train_rows=400", "task.num_val_rows=16", "eval.every=0", "eval.before_train=false",
            "checkpoint.every=1", "checkpoint.keep_last=0", "checkpoint.save_model=false",
            "logging.tensorboard=false", "logging.plot=false"]


def run_metrics(run_dir: Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def resume_from(source: Path, run_dir: Path, step: int) -> None:
    """`run_dir` as a run interrupted after `step` steps: its checkpoint and metrics."""
    name = f"step_{step:06d}"
    shutil.copytree(source / "checkpoints" / name, run_dir / "checkpoints" / name)
    rows = (source / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "metrics.jsonl").write_text("".join(rows[:step]))
