"""A whole GRPO step, megatron-armor against TRL's `GRPOTrainer`, on the same model, prompts and batch, in one run.

The model is the demo's warm-started tiny Qwen2 (the synthetic arithmetic task, made and cached by the first
run); each RL step samples 16 prompts x 8 responses of at most 24 new tokens at temperature 1 and takes one
optimizer step on all 128 (no KL, no group filtering: what TRL's GRPO does by default with beta 0). Both run on
the CPU with the same threads; the median step time over the steps after the first is compared.

- megatron-armor: `armor train` (one process, the in-process engine, Megatron actor), perf/step_seconds;
- TRL: `GRPOTrainer.train()` timed per step by a callback, in an environment that has trl installed
  (`pip install -e .[bench]`, or pass `--trl-python` of another environment that can import megatron_armor
  through PYTHONPATH). Without TRL the script says so and prints megatron-armor's step alone.

    python benchmarks/bench_grpo_step.py --steps 6
    python benchmarks/bench_grpo_step.py --trl-python /path/to/env/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, GROUP, NEW_TOKENS, LR = 16, 8, 24, 1e-5

TRL_SCRIPT = textwrap.dedent('''
    import json, sys, time
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from megatron_armor.rewards.arithmetic import verify

    model, train_path, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    rows = [json.loads(line) for line in open(train_path)]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

    def reward(completions, answer, **_):
        return [verify(c, {"answer": a})[0] for c, a in zip(completions, answer)]

    class Timer(TrainerCallback):
        times = []
        def on_step_begin(self, args, state, control, **_):
            self.start = time.perf_counter()
        def on_step_end(self, args, state, control, **_):
            self.times.append(time.perf_counter() - self.start)

    config = GRPOConfig(output_dir=out, per_device_train_batch_size=BATCH, num_generations=GROUP,
                        max_completion_length=NEW_TOKENS, max_steps=steps, learning_rate=LR, beta=0.0,
                        temperature=1.0, top_p=1.0, report_to=[], use_cpu=True, bf16=False, save_strategy="no",
                        logging_steps=10**6, warmup_steps=0, lr_scheduler_type="constant", seed=1234)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=AutoTokenizer.from_pretrained(model), callbacks=[Timer()])
    trainer.train()
    print(json.dumps(Timer.times))
''')


def armor_overrides(steps: int, run_dir: Path, cache: Path) -> list[str]:
    return [
        "--config", str(ROOT / "examples" / "tiny" / "armor.yaml"), "--algo", "grpo", "--tp", "1",
        "--max-steps", str(steps), "--run-dir", str(run_dir), "--task.cache_dir", str(cache),
        "--rollout.sampling.actor_n", str(GROUP), "--rollout.sampling.n_samples", str(GROUP),
        "--rollout.sampling.max_new_tokens", str(NEW_TOKENS), "--train.train_batch_size", str(PROMPTS),
        "--train.gen_batch_size", str(PROMPTS), "--train.mini_batch_size", str(PROMPTS),
        "--micro_batching.micro_batch_size", str(PROMPTS * GROUP), "--optimizer.lr", str(LR),
        "--optimizer.warmup_steps", "0",
        "--algorithm.filter_groups", "false", "--eval.every", "0", "--eval.before_train", "false",
        "--checkpoint.every", "100000", "--checkpoint.save_model", "false", "--logging.tensorboard", "false",
        "--logging.plot", "false", "--logging.progress_bar", "false",
    ]


def run_armor(steps: int, work: Path, cache: Path) -> list[float]:
    """perf/step_seconds of each step of `armor train`."""
    run_dir = work / "armor"
    cmd = [str(Path(sys.executable).parent / "armor"), "train", *armor_overrides(steps, run_dir, cache)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    skipped = [row["step"] for row in rows if row.get("train/update_skipped")]
    if skipped:  # a step without an update would time only the rollout
        raise RuntimeError(f"megatron-armor skipped the update of steps {skipped}: not a like-for-like step")
    return [row["perf/step_seconds"] for row in rows if "perf/step_seconds" in row]


def task_files(cache: Path) -> tuple[str, str]:
    """(warm-started model, training prompts) of the demo's synthetic task in `cache` (made by the armor run)."""
    from megatron_armor.config import load_config
    from megatron_armor.trainer.run.task_setup import prepare_task

    cfg = load_config(str(ROOT / "examples" / "tiny" / "armor.yaml"), [f"task.cache_dir={cache}"])
    paths = prepare_task(cfg, is_main=True, needs_teacher=False)
    return paths.model_path, paths.train_path


def run_trl(python: str, steps: int, work: Path, cache: Path) -> list[float] | None:
    """Seconds of each `GRPOTrainer` step, or None when `python` cannot import trl."""
    if subprocess.run([python, "-c", "import trl"], capture_output=True).returncode != 0:
        return None
    model, train_path = task_files(cache)
    script = work / "trl_grpo.py"
    settings = {"BATCH": PROMPTS * GROUP, "GROUP": GROUP, "NEW_TOKENS": NEW_TOKENS, "LR": LR}
    script.write_text("".join(f"{name} = {value!r}\n" for name, value in settings.items()) + TRL_SCRIPT)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([python, str(script), model, train_path, str(steps), str(work / "trl")], env=env,
                          check=True, capture_output=True, text=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="RL steps of each run (the first is not timed)")
    parser.add_argument("--trl-python", default=sys.executable, help="a Python that can import trl")
    parser.add_argument("--cache", default=str(ROOT / ".cache" / "megatron-armor"), help="the synthetic task's cache")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        armor = run_armor(args.steps, work, Path(args.cache))
        trl = run_trl(args.trl_python, args.steps, work, Path(args.cache))
    armor_step = statistics.median(armor[1:])
    print(f"GRPO step, {PROMPTS} prompts x {GROUP} samples, {NEW_TOKENS} new tokens, "
          f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, median of steps 2..{args.steps}:")
    print(f"  megatron-armor   {armor_step:7.3f} s  (steps: {', '.join(f'{t:.2f}' for t in armor)})")
    if trl is None:
        print(f"  TRL              not installed in {args.trl_python} (pip install -e .[bench]); no ratio")
        return
    trl_step = statistics.median(trl[1:])
    print(f"  TRL GRPOTrainer  {trl_step:7.3f} s  (steps: {', '.join(f'{t:.2f}' for t in trl)})")
    print(f"  ratio megatron-armor / TRL: {armor_step / trl_step:.2f}")


if __name__ == "__main__":
    main()
