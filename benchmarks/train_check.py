"""The one-GPU training check (issue 29; `scripts/gpu_checks.sh train` runs it): ARMOR with the recipes' settings
on a Qwen2-0.5B-shaped model built here with random weights, its figures written to one JSON file.

Settings as the shipped recipes train: bf16 parameters (fp32 master weights and grads), Megatron's distributed
optimizer, the fused logprob head, Transformer Engine's layer spec when it is installed (else the local one), the
in-process engine on the same GPU. The synthetic arithmetic task gives the prompts; the weights are random, so the
reward is `first_char_is_digit` (about 1 sample in 10 of a random model over the task's 98-character tokenizer), which
keeps groups with a correct anchor and some spread: the check measures the path and its speed, not learning. The model
has Qwen2-0.5B's head and layer counts (14 heads, 2 KV heads, 24 layers) at hidden 1024 and FFN 5632, 0.47 B
parameters in its decoder, and the task's 128-entry vocabulary: a random 151936-token head would sample ids the
character tokenizer does not have (decoded as nothing), and no sample would ever be rewarded.

Runs `--steps` RL steps with a checkpoint every `--steps // 2`, then resumes a copy of the run from the middle
checkpoint for two steps and compares them with the uninterrupted run's. Writes `--out` (JSON):
    device, torch, model_params          where it ran, and the model's parameter count
    steps, step_seconds {median, min, max}  wall time per RL step (rollout + update + weight push), steps 2..N
    tokens_per_second {median, min, max}    the trainer's perf/tokens_per_second
    tflops_per_gpu {median, min, max}       achieved: the trainer's FLOPs of each step (planning/flops.py on the real
                                            lengths) / its time
    plan_flops_per_step, plan_tflops     `armor plan`'s FLOPs of one step (every sequence at its max length: an
                                            upper bound), and that over the median step time
    peak_memory_bytes, plan_training_peak_bytes  torch's max allocated over the run (trainer and engine, one GPU)
                                            against `armor plan`'s training peak (trainer only, reserve included)
    logprob_mismatch {median, max}       mismatch/logprob_abs_diff: engine vs trainer logprobs of the same tokens
    resume {step, reward_equal, policy_loss_diff, grad_norm_rel_diff}  the resumed steps against the uninterrupted
`--device cpu` is the dry run of the same path (the tests' tiny model, bf16 on the CPU; its speed figures mean
nothing): what the CPU test runs (tests/test_train_check.py).

    python benchmarks/train_check.py --device cuda --out train_check.json   # ~0.5B, 20 steps (a few minutes)
    python benchmarks/train_check.py --device cpu --out train_check.json    # dry run: tiny model, 4 steps
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# ~0.5 B parameters, Qwen2-shaped (see the module docstring); the CPU dry run's is the tests' tiny model.
SHAPES = {
    "cuda": dict(hidden_size=1024, num_layers=24, num_attention_heads=16, num_key_value_heads=2, intermediate_size=5632,
                 max_position_embeddings=2048),
    "cpu": dict(),
}


def first_char_is_digit(response: str, row: dict) -> tuple[float, bool]:
    """The check's reward: 1 when the response starts with a digit, else 0 (correct alike)."""
    del row
    correct = response[:1].isdigit()
    return float(correct), correct


def overrides(run_dir: Path, model: Path, cache: Path, steps: int, max_new_tokens: int) -> list[str]:
    """The recipe settings on one device, as `armor train` config overrides."""
    return [
        f"model.path={model}", "model.params_dtype=bfloat16",
        "parallel.tensor_parallel_size=1", "parallel.data_parallel_size=1", "optimizer.use_distributed_optimizer=true",
        "train.logprob_head=fused", f"train.max_steps={steps}", "optimizer.warmup_steps=1",
        f"rollout.sampling.max_new_tokens={max_new_tokens}", f"reward.train_fn={Path(__file__).resolve()}:first_char_is_digit", f"task.cache_dir={cache}", "task.warm_start.steps=0",
        "task.num_train_rows=400", "task.num_val_rows=16", "eval.every=0", "eval.before_train=false",
        f"checkpoint.every={steps // 2}", "checkpoint.keep_last=0", "checkpoint.save_model=false",
        f"logging.run_dir={run_dir}", "logging.tensorboard=false", "logging.plot=false",
    ]


def metrics(run_dir: Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--steps", type=int, default=None, help="RL steps (default: 20 on cuda, 4 on cpu)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: 128 on cuda, 16 on cpu")
    parser.add_argument("--workdir", type=Path, default=None, help="where the model and the runs go (default: temp)")
    args = parser.parse_args()
    steps = args.steps or (20 if args.device == "cuda" else 4)
    max_new_tokens = args.max_new_tokens or (128 if args.device == "cuda" else 16)
    if steps < 4 or steps % 2:
        parser.error("--steps must be even and at least 4 (a checkpoint in the middle, two resumed steps)")
    if args.device == "cpu":
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # the dry run stays on the CPU path on any machine
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused head's kernel runs in Triton's interpreter
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1"})
    import torch

    from megatron_armor.config import load_config
    from megatron_armor.models.tiny import make_tiny_checkpoint
    from megatron_armor.planning.planner import Hardware, plan_run
    from megatron_armor.trainer.run.train import run_training
    from megatron_armor.utils.net import free_port

    work = args.workdir or Path(tempfile.mkdtemp(prefix="armor-train-check-"))
    model = make_tiny_checkpoint(work / "model", arch="qwen2", seed=0, **SHAPES[args.device])
    config = str(REPO / "examples" / "tiny" / "armor.yaml")

    def run(run_dir: Path, until: int, *, resume: bool) -> None:
        os.environ["MASTER_PORT"] = str(free_port())
        cfg = load_config(config, overrides(run_dir, model, work / "cache", until, max_new_tokens))
        if run_training(cfg, resume=resume) != 0:
            raise SystemExit(f"armor train failed ({run_dir}); its log is above")

    on_gpu = args.device == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    full = work / "full"
    run(full, steps, resume=False)
    peak = torch.cuda.max_memory_allocated() if on_gpu else None
    rows = metrics(full)

    middle, resumed = steps // 2, work / "resumed"
    name = f"step_{middle:06d}"
    shutil.copytree(full / "checkpoints" / name, resumed / "checkpoints" / name)
    (resumed / "metrics.jsonl").write_text("".join((full / "metrics.jsonl").read_text().splitlines(keepends=True)[:middle]))
    run(resumed, middle + 2, resume=True)
    again = metrics(resumed)

    cfg = load_config(config, overrides(full, model, work / "cache", steps, max_new_tokens))
    plan = plan_run(cfg, Hardware(gpus=1, gpu_memory_gb=torch.cuda.get_device_properties(0).total_memory / 1e9
                                  if on_gpu else 80.0))
    timed = [rows[step] for step in range(2, steps + 1)]  # step 1 compiles kernels and warms the allocator
    step_seconds = spread([row["perf/step_seconds"] for row in timed])
    report = {
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu (dry run)", "torch": torch.__version__,
        "model_params": plan.memory.state.params, "steps": steps,
        "step_seconds": step_seconds,
        "tokens_per_second": spread([row["perf/tokens_per_second"] for row in timed]),
        "tflops_per_gpu": spread([row["perf/tflops_per_gpu"] for row in timed]),
        "plan_flops_per_step": plan.flops.total,
        "plan_tflops": plan.flops.total / step_seconds["median"] / 1e12,
        "peak_memory_bytes": peak, "plan_training_peak_bytes": plan.memory.training_peak,
        "logprob_mismatch": {"median": statistics.median(row["mismatch/logprob_abs_diff"] for row in timed),
                             "max": max(row["mismatch/logprob_abs_diff"] for row in timed)},
        "resume": {
            "step": middle + 1,
            "reward_equal": all(again[s]["train/reward_mean"] == rows[s]["train/reward_mean"]
                                for s in (middle + 1, middle + 2)),
            "policy_loss_diff": max(abs(again[s]["loss/policy_loss"] - rows[s]["loss/policy_loss"])
                                    for s in (middle + 1, middle + 2)),
            "grad_norm_rel_diff": max(abs(again[s]["optim/grad_norm"] / rows[s]["optim/grad_norm"] - 1)
                                      for s in (middle + 1, middle + 2)),
        },
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
