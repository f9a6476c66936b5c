"""Helpers of the tests that run `armor train` and resume it from a checkpoint (tests/workers/train_run.py)."""

import json
import shutil
from pathlib import Path


# the LoRA guide's command (docs/guides/lora.md) on a smaller batch: 4 prompts per RL step, one optimizer step each
LORA = ["parallel.tensor_parallel_size=1", "model.lora.rank=8", "optimizer.lr=1e-4",
        "train.train_batch_size=4", "train.gen_batch_size=8", "train.mini_batch_size=4"]


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


def adapter_push_bytes(actor: dict) -> int:
    """Bytes of the PEFT tensors of a saved actor's adapters: A and B of each Megatron adapter, A once per HF layer
    its fused layer splits into (QKV: q, k, v; a gated fc1: gate, up), B split among them."""
    copies = {"linear_qkv": 3, "linear_fc1": 2}
    return sum(tensor.nbytes * (copies.get(key.split(".")[-2].removesuffix("_adapter"), 1) if key.endswith("lora_a")
                                else 1)
               for key, tensor in actor.items() if "_adapter." in key)
