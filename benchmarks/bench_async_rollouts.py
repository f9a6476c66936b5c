"""Rollout modes side by side: the same RL run with every `rollout.mode` (sync, one_step_off, async, and any mode the
config adds later) and async with partial rollouts (run async_partial), with the trainer and the rollout servers as
separate processes and a long-tailed mix of response lengths; prints samples per second, overlap fraction and idle
times of each, and the speedup that sync's phase times predict for a machine where rollout and training have devices
of their own.

The task is the tiny synthetic arithmetic one of examples/tiny/armor.yaml run as GRPO (every sample on-policy, so
one kind of server), tensor parallel size --tp, from the same warm start and seed in every mode. `--algorithm armor`
runs the recipe's ARMOR instead, with --servers reference servers of its own beside the actor's: the anchors of a
generation batch are sampled in line after its actor samples in sync mode, beside them (on a thread of their own) in
one_step_off and ahead of them in async (trainer/rollouts/anchor_prefetch.py), and the "anchor s" column shows how long
a step's generation waited for its anchors (perf/anchor_rollout_seconds). Each mode starts
--servers fresh `armor serve-local` processes (rollout/http_server.py: the CPU engine behind SGLang's HTTP schema,
started by launch/server_process.py as the Ray launcher does), then runs `armor train --rollout.backend sglang`
as a subprocess (torchrun when --tp > 1) and reads its metrics.jsonl.

The long tail: at --temperature 1.6 the warm-started model mostly answers in ~25 tokens and EOS, but now and
then it wanders and runs on to --max-new-tokens (64). A generation request decodes until its longest response ends, so
those few responses set the rollout's time, as the long reasoning traces of real runs do. Before the runs one server
answers a generation batch of the training prompts with the training sampling, and the script prints that mix
(length quantiles, the share cut at the limit). Micro-batches of one sequence and mini-batches of one prompt
(--micro-batch, --mini-batch) make the tiny model's training phase a larger share of a sync step (the shares
measured: docs/benchmarks.md, "Rollout modes side by side").

Figures, per mode: samples/s over all steps, the others as means over the steps after the first (one_step_off's
first generates its rollout in the foreground, filling the pipeline; its cost is amortized over --steps):
  samples/s       on-policy samples generated and scored (filter/prompts_generated x actor_n) over the steps' time
                  (a one_step_off step logs the rollout generated during the step before, so only whole-run sums
                  match samples to the time that generated them)
  rollout s       perf/rollout_seconds: the trainer waiting for this step's rollout (one_step_off: ~0, it was ready)
  train s         perf/train_seconds: advantages, logprobs, update (the weight push and the rest of the step follow)
  trainer idle    perf/trainer_idle_seconds (sync: the whole rollout, by construction)
  rollout idle    perf/rollout_idle_seconds (sync: the rest of the step, the servers wait for new weights)
  overlap         perf/overlap_fraction: share of the rollout's time that ran beside training (sync: 0)
  partial         async/partial_fraction (run async_partial, rollout.partial_rollouts): share of the trained samples
                  a weight push interrupted and that continued under the new weights
  anchor s        perf/anchor_rollout_seconds (--algorithm armor): the step's generation batches waiting for their
                  anchors (sync: the whole anchor phase, sampled after the actor's samples)

Predicted speedup on separate devices, from the sync run: a sync step takes s = rollout + train + rest (rest: the
weight push and bookkeeping, which no mode overlaps). With rollout and training on devices of their own, one_step_off
runs step t+1's rollout beside step t's training, so a step takes max(rollout, train) + rest = s - min(rollout, train):
    predicted = sum_steps s / sum_steps (s - min(rollout, train)),
which is sum (rollout + train) / sum max(rollout, train) when rest is 0. In sync the trainer idles for the whole
rollout and the servers for the whole training phase, so these are sync's idle times: the time one_step_off can hide
is the smaller of the two idle times per step. On this box the figure measured for one_step_off is not that: the
servers and the trainer share the same CPU cores (and other jobs' load), so the overlapped phases slow each other
down, and the measured speedup is what overlap gains on shared compute, a lower bound of the separate-device figure.

    python benchmarks/bench_async_rollouts.py --steps 8 --out runs/bench-async
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import typing
from pathlib import Path

from megatron_armor.algorithms import algorithm_class
from megatron_armor.config import load_config
from megatron_armor.config.rollout import RolloutConfig
from megatron_armor.data.datasets import PromptSampler, load_prompt_rows
from megatron_armor.launch.server_process import RolloutServer, ServerConfig
from megatron_armor.models.tokenizer import load_tokenizer
from megatron_armor.rollout.base import SamplingParams
from megatron_armor.rollout.sglang_engine import SGLangEngine
from megatron_armor.trainer.run.task_setup import prepare_task

CONFIG = Path(__file__).parents[1] / "examples" / "tiny" / "armor.yaml"
# every rollout.mode the config knows, and async with partial rollouts: the runs' names and their own fields
RUNS = {**{mode: [f"rollout.mode={mode}"] for mode in typing.get_args(typing.get_type_hints(RolloutConfig)["mode"])},
        "async_partial": ["rollout.mode=async", "rollout.partial_rollouts=true"]}
GRPO_N = 8  # GRPO's samples per prompt (ARMOR: the recipe's actor_n and anchors)
COLUMNS = ("samples/s", "rollout s", "train s", "step s", "trainer idle", "rollout idle", "overlap", "partial",
           "anchor s")


def overrides(args: argparse.Namespace, run_dir: Path | None = None) -> list[str]:
    """The runs' shared config (--algorithm on the tiny task, the long-tailed sampling), without the mode and
    servers."""
    group = [f"rollout.sampling.n_samples={GRPO_N}", f"rollout.sampling.actor_n={GRPO_N}"] if args.algorithm == "grpo" \
        else []
    return [
        f"task.cache_dir={args.out / 'cache'}", f"parallel.tensor_parallel_size={args.tp}",
        f"algorithm.name={args.algorithm}", *group,
        f"rollout.sampling.temperature={args.temperature}", f"rollout.sampling.max_new_tokens={args.max_new_tokens}",
        f"train.max_steps={args.steps}", f"train.seed={args.seed}", f"train.gen_batch_size={args.gen_batch}",
        f"micro_batching.micro_batch_size={args.micro_batch}", f"train.mini_batch_size={args.mini_batch}",
        "eval.every=0", "eval.before_train=false", f"checkpoint.every={args.steps + 1}", "checkpoint.save_model=false",
        "logging.tensorboard=false", "logging.plot=false", "logging.progress_bar=false",
        *([f"logging.run_dir={run_dir}"] if run_dir else []),
    ]


def start_servers(model: str, args: argparse.Namespace, log_dir: Path) -> list[RolloutServer]:
    """--servers fresh `armor serve-local` processes of `model` (one engine thread each), healthy."""
    spec = ServerConfig(model_path=model, kind="local", seed=args.seed, startup_timeout_s=300.0, poll_interval_s=0.5)
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the servers: one core each at most
    servers = [RolloutServer(spec, index, host="127.0.0.1", log_dir=str(log_dir)) for index in range(args.servers)]
    for server in servers:
        server.wait_healthy()
    return servers


def length_mix(urls: list[str], cfg, args: argparse.Namespace) -> str:
    """The response lengths of one training generation batch with the training sampling (one seed)."""
    paths = prepare_task(cfg, is_main=True, needs_teacher=False)
    tokenizer = load_tokenizer(paths.model_path)
    rows = load_prompt_rows(paths.train_path, tokenizer=tokenizer, max_prompt_length=cfg.data.max_prompt_length)
    actor_n = algorithm_class(cfg.algorithm.name).on_policy_samples(cfg.rollout.sampling)
    prompts = [row.prompt_ids for row in PromptSampler(rows, args.gen_batch, seed=args.seed).next_batch()] * actor_n
    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                              stop_token_ids=(tokenizer.eos_token_id,), seed=args.seed)
    lengths = sorted(len(g.response_ids) for g in SGLangEngine(urls).generate(prompts, sampling))
    quantile = {q: lengths[min(len(lengths) - 1, int(q * len(lengths)))] for q in (0.5, 0.9, 0.99)}
    at_limit = sum(n >= args.max_new_tokens for n in lengths) / len(lengths)
    return (f"{len(lengths)} responses at temperature {args.temperature}: median {quantile[0.5]}, p90 {quantile[0.9]}, "
            f"p99 {quantile[0.99]}, max {lengths[-1]} tokens; {at_limit:.1%} cut at max_new_tokens "
            f"{args.max_new_tokens}")


def train(mode: str, urls: list[str], ref_urls: list[str], args: argparse.Namespace) -> list[dict]:
    """`armor train` as run `mode` of RUNS against the servers at `urls` (and the reference servers at `ref_urls`,
    ARMOR) (a subprocess); its metrics rows."""
    run_dir = args.out / mode
    refs = [f"rollout.sglang.ref_urls={','.join(ref_urls)}"] if ref_urls else []
    fields = [*overrides(args, run_dir), *RUNS[mode], "rollout.backend=sglang",
              f"rollout.sglang.urls={','.join(urls)}", "rollout.sglang.router=none", *refs]
    cmd = [sys.executable, "-m", "megatron_armor.cli", "train", "--config", str(CONFIG), "--overwrite"]
    for field in fields:
        cmd += [f"--{field.split('=', 1)[0]}", field.split("=", 1)[1]]
    with (args.out / f"{mode}.log").open("w") as log:
        if subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}):
            raise SystemExit(f"armor train in mode {mode} failed: see {args.out / f'{mode}.log'}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summarize(rows: list[dict], actor_n: int) -> dict[str, float]:
    """The COLUMNS of one run (`actor_n` on-policy samples per prompt): samples/s over all its steps (every rollout
    generated is trained, one_step_off's ahead of its step), the rest as means over the steps after the first."""
    seconds = sum(row["perf/step_seconds"] for row in rows)
    steady = rows[1:]
    rollout = [row["perf/rollout_seconds"] for row in steady]
    step = [row["perf/step_seconds"] for row in steady]
    return {
        "samples/s": sum(row["filter/prompts_generated"] * actor_n for row in rows) / seconds,
        "rollout s": statistics.mean(rollout),
        "train s": statistics.mean(row["perf/train_seconds"] for row in steady),
        "step s": statistics.mean(step),
        "trainer idle": statistics.mean(row.get("perf/trainer_idle_seconds", r) for row, r in zip(steady, rollout)),
        "rollout idle": statistics.mean(row.get("perf/rollout_idle_seconds", s - r)
                                        for row, s, r in zip(steady, step, rollout)),
        "overlap": statistics.mean(row.get("perf/overlap_fraction", 0.0) for row in steady),
        "partial": statistics.mean(row.get("async/partial_fraction", 0.0) for row in steady),
        "anchor s": statistics.mean(row.get("perf/anchor_rollout_seconds", 0.0) for row in steady),
    }


def predicted_speedup(sync_rows: list[dict]) -> float:
    """sum s / sum (s - min(rollout, train)) over sync's steps after the first (see the module docstring)."""
    steady = sync_rows[1:]
    total = sum(row["perf/step_seconds"] for row in steady)
    hidden = sum(min(row["perf/rollout_seconds"], row["perf/train_seconds"]) for row in steady)
    return total / (total - hidden)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="RL steps of every run")
    parser.add_argument("--modes", nargs="+", default=list(RUNS), choices=list(RUNS),
                        help="runs: every rollout.mode, and async_partial (async with rollout.partial_rollouts)")
    parser.add_argument("--servers", type=int, default=1, help="armor serve-local processes per run")
    parser.add_argument("--tp", type=int, default=1, help="trainer ranks (tensor parallel size)")
    parser.add_argument("--temperature", type=float, default=1.6, help="sampling temperature (the long tail)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="where the long responses are cut")
    parser.add_argument("--gen-batch", type=int, default=8, help="prompts per generation batch (train.gen_batch_size)")
    parser.add_argument("--micro-batch", type=int, default=1, help="micro_batching.micro_batch_size (sequences)")
    parser.add_argument("--mini-batch", type=int, default=1, help="train.mini_batch_size (prompts per optimizer step)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--algorithm", choices=("grpo", "armor"), default="grpo",
                        help="grpo (actor servers only) or armor (also --servers reference servers for the anchors)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-async"))
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(CONFIG, overrides(args))
    model = prepare_task(cfg, is_main=True, needs_teacher=False).model_path  # the warm start, cached under --out
    results, seconds = {}, {}
    for mode in args.modes:
        servers = start_servers(model, args, args.out / "server-logs")
        refs = start_servers(model, args, args.out / "server-logs") if args.algorithm == "armor" else []
        try:
            urls = [server.url for server in servers]
            if not results:
                print(f"response lengths: {length_mix(urls, cfg, args)}", flush=True)
            start = time.perf_counter()
            results[mode] = train(mode, urls, [server.url for server in refs], args)
            seconds[mode] = time.perf_counter() - start
        finally:
            for server in servers + refs:
                server.stop()
    actor_n = algorithm_class(cfg.algorithm.name).on_policy_samples(cfg.rollout.sampling)
    summaries = {mode: summarize(rows, actor_n) for mode, rows in results.items()}
    print(f"\n{args.algorithm}, {args.steps} steps per mode, {args.servers} server(s)"
          f"{' and as many reference servers' if args.algorithm == 'armor' else ''}, trainer TP {args.tp}, "
          f"seed {args.seed}; samples/s "
          f"over all steps, the rest means per step after the first, seconds")
    print(f"{'mode':<14}" + "".join(f"{c:>13}" for c in COLUMNS) + f"{'wall s':>9}{'vs sync':>9}")
    for mode, s in summaries.items():
        versus = s["samples/s"] / summaries["sync"]["samples/s"] if "sync" in summaries else float("nan")
        print(f"{mode:<14}" + "".join(f"{s[c]:>13.3f}" for c in COLUMNS) + f"{seconds[mode]:>9.0f}{versus:>9.2f}")
    if "sync" in results:
        print(f"predicted one_step_off speedup with rollout and training on devices of their own (sync's phase "
              f"times): {predicted_speedup(results['sync']):.2f}x")


if __name__ == "__main__":
    main()
