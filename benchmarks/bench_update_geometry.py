"""Update geometry of SFT, OPD and RLVR (GRPO) from one base on the tiny arithmetic task (spec opd.md §2, §5, §6).

Setup (all three arms start from the same W0 and share every optimizer setting):
- W0 (base): the supervised warm start of the tiny Qwen2 model that `examples/tiny/opd.yaml` builds
  (`prepare_task` with a non-OPD algorithm; cached under task.cache_dir).
- OPD teacher: W0 further SFT-trained on the worked solutions with `cached_warm_start` (a longer,
  much stronger run than the SFT arm; cached). The paper distils a larger model; here the teacher
  has the student's shape.
- SFT arm: continued SFT of W0 on `prompt + solution + EOS` (the warm start's batch function), with
  the trainer's Adam settings, warmup schedule and grad clip; one "step" is as many optimizer steps,
  on as many sequences, as one RL step of the config (train_batch_size / mini_batch_size steps of
  mini_batch_size x n_samples sequences).
- OPD arm: `armor train --algo opd` with the teacher above; RLVR arm: `armor train --algo grpo`
  (binary verifier reward, zero-variance groups filtered). Both TP 1, same config otherwise.
Every arm keeps snapshots at `--checkpoints` evenly spaced steps; `megatron_armor.diagnostics`
compares each against W0 (small k for the 64-wide model) and the final values are set side by side
with the paper's numbers and expected orderings. Sampled (T=1) accuracy on the validation rows is
shown for context.

    .venv/bin/python benchmarks/bench_update_geometry.py                  # 30 steps per arm, 5 snapshots, lr 1e-5
    .venv/bin/python benchmarks/bench_update_geometry.py --steps 40 --lr 1e-6 --out runs/geometry-lr1e-6
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from megatron_armor.config import ArmorConfig, WarmStartConfig, load_config
from megatron_armor.convert.hf_export import read_megatron_checkpoint
from megatron_armor.convert.weights import HFCheckpointReader
from megatron_armor.diagnostics import DiagnoseConfig, Snapshot, diagnose_sources
from megatron_armor.models.tokenizer import load_tokenizer
from megatron_armor.rewards.arithmetic import make_rows
from megatron_armor.trainer.checkpointing.checkpoint import list_checkpoints
from megatron_armor.trainer.run.task_setup import prepare_task
from megatron_armor.trainer.run.warmstart import _sft_batch, cached_warm_start, sampled_accuracy
from megatron_armor.trainer.update.optimizer import learning_rate

REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO / "examples" / "tiny" / "opd.yaml"
METHODS = ("SFT", "OPD", "RLVR")
TEACHER = WarmStartConfig(steps=800, lr=1e-3, eval_every=100, eval_rows=128, target_accuracy=0.95)
SETTINGS = DiagnoseConfig(k_angles=8, k_sim=4, mask_rank=8, k_hill=4)

Weights = dict[str, torch.Tensor]  # HF tensor name -> tensor


class TensorDictSource:
    """A `WeightSource` over HF-named tensors held in memory."""

    def __init__(self, weights: Weights) -> None:
        self.weights = weights

    def names(self) -> set[str]:
        return set(self.weights)

    def get(self, name: str) -> torch.Tensor:
        return self.weights[name]


def task_config(args: argparse.Namespace) -> ArmorConfig:
    """The tiny config at TP 1 with this benchmark's learning rate (a non-OPD algorithm, so the task's
    model is the warm start rather than the untrained student)."""
    return load_config(TINY_CONFIG, ["algorithm.name=grpo", "parallel.tensor_parallel_size=1", f"optimizer.lr={args.lr}"])


def task_rows(cfg: ArmorConfig) -> tuple[list[dict], list[dict]]:
    """The synthetic task's (train, validation) rows, drawn as `prepare_task` draws them."""
    return (make_rows(cfg.task.num_train_rows, seed=cfg.train.seed),
            make_rows(cfg.task.num_val_rows, seed=cfg.train.seed + 1))


def prepare_base_and_teacher(cfg: ArmorConfig) -> tuple[Path, Path]:
    """(W0, teacher) HF directories: the tiny task's warm start, and that further SFT-trained (both cached)."""
    base = Path(prepare_task(cfg, is_main=True, needs_teacher=False).model_path)  # the warm start is the student
    teacher = cached_warm_start(base, task_rows(cfg)[0], Path(cfg.task.cache_dir) / "warm-start", TEACHER,
                                seed=cfg.train.seed)
    return base.resolve(), Path(teacher.path).resolve()


def run_sft(cfg: ArmorConfig, base: Path, steps: int, save_every: int) -> dict[int, Weights]:
    """Continue SFT from `base`; snapshots every `save_every` steps (an RL step's worth of optimizer steps each)."""
    t = cfg.train
    torch.manual_seed(t.seed)
    rng = random.Random(t.seed)
    rows = task_rows(cfg)[0]
    tokenizer = load_tokenizer(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.train()
    schedule = cfg.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=schedule.lr, betas=(schedule.adam_beta1, schedule.adam_beta2),
                                  eps=schedule.adam_eps, weight_decay=schedule.weight_decay)
    updates_per_step = t.train_batch_size // t.mini_batch_size
    batch_rows = t.mini_batch_size * cfg.rollout.sampling.n_samples
    snapshots = {}
    for step in range(1, steps + 1):
        for _ in range(updates_per_step):
            input_ids, labels = _sft_batch(tokenizer, rng.sample(rows, batch_rows))
            optimizer.zero_grad()
            model(input_ids=input_ids, labels=labels).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), schedule.grad_clip)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step - 1, schedule)  # the RL run's rate at this step
            optimizer.step()
        if step % save_every == 0:
            snapshots[step] = {name: p.detach().clone() for name, p in model.state_dict().items()}
    return snapshots


def run_rl(args: argparse.Namespace, algo: str, base: Path, run_dir: Path, extra: list[str]) -> None:
    """`armor train --algo <algo>` from `base` at TP 1, checkpointing every `steps / checkpoints` steps."""
    command = [
        sys.executable, "-m", "megatron_armor.cli", "train", "--config", str(TINY_CONFIG), "--algo", algo, "--tp", "1",
        "--max-steps", str(args.steps), "--run-dir", str(run_dir), "--overwrite", "--model.path", str(base),
        "--task.warm_start.steps", "0", "--optimizer.lr", str(args.lr),
        "--checkpoint.every", str(args.steps // args.checkpoints), "--checkpoint.keep_last", "0",
        "--eval.every", "0", "--eval.before_train", "false", "--logging.plot", "false",
        "--logging.tensorboard", "false", *extra,
    ]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True)


def checkpoint_weights(step_dir: Path) -> Weights:
    """HF-named weights of a training checkpoint's actor (`step_N/model/`, checkpoint.save_model; any layout)."""
    reader = read_megatron_checkpoint(step_dir / "model")
    return {name: tensor for mapping in reader.mappings for name, tensor in zip(mapping.hf_names, reader.read(mapping))}


def run_checkpoints(run_dir: Path) -> dict[int, Weights]:
    """Every complete checkpoint of an `armor train` run, by step."""
    return {step: checkpoint_weights(path) for step, path in list_checkpoints(run_dir / "checkpoints")}


def accuracy(base: Path, weights: Weights | None, rows: list[dict], seed: int) -> float:
    """Sampled (T=1) validation accuracy of `base` with `weights` loaded (None: the base itself)."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if weights is not None:
        model.load_state_dict(weights)
    model.eval()
    return sampled_accuracy(model, load_tokenizer(base), rows, seed=seed)


# ---- the side-by-side table -------------------------------------------------------------------------

Summaries = list[dict]  # a diagnose report's "checkpoints" entries, oldest first


def _end(key: str) -> Callable[[Summaries], float]:
    return lambda s: s[-1]["all"][key]


def _angle(s: Summaries) -> float:
    return (s[-1]["all"]["angle_left_mean"] + s[-1]["all"]["angle_right_mean"]) / 2


@dataclass(frozen=True)
class Comparison:
    """One row of the table: a value per method, the paper's values, and the ordering the paper reports."""

    label: str
    value: Callable[[Summaries], float]
    paper: str
    expected: str  # "increasing" (SFT < OPD < RLVR), "decreasing" (SFT > OPD > RLVR) or "opd_highest"
    percent: bool = False


COMPARISONS = (
    Comparison("unchanged fraction (bf16)", _end("unchanged_fraction"), "8.1% / 51.6% / 77.2%", "increasing", True),
    Comparison("update density", _end("update_density"), "92.73% / 46.28% / 27.76%", "decreasing", True),
    Comparison("principal angle mean (deg)", _angle, ">10 / ~1 / <0.5", "decreasing"),
    Comparison("NSS", _end("spectral_drift"), "~1e-3 / ~1e-4 / ~1e-5", "decreasing"),
    Comparison("principal-mask overlap", _end("overlap_principal"), "highest / <random / lowest", "decreasing", True),
    Comparison("low-magnitude overlap", _end("overlap_low_magnitude"), "31.88% / 53.59% / 73.48%", "increasing", True),
    Comparison("||dW||_F", _end("update_norm"), "largest / above RLVR / smallest", "decreasing"),
    Comparison("Sim_K(first ckpt, end)", lambda s: s[0]["all"]["sim_k"], "rises / ~1 early / rises", "opd_highest"),
)
# Over-time readouts: (label, metric key, the paper's trend per method); trends compare first and last checkpoint.
TRAJECTORIES = (
    ("stable rank of dW_t", "stable_rank", ("grows", "flat", "shrinks")),
    ("Hill index of dW_t", "hill_index", ("grows", "flat", "shrinks")),
)
FLAT_BAND = 0.10  # |last / first - 1| below this reads as flat


def ordering_held(values: list[float], expected: str) -> bool:
    sft, opd, rlvr = values
    if expected == "increasing":
        return sft < opd < rlvr
    if expected == "decreasing":
        return sft > opd > rlvr
    return opd > max(sft, rlvr)


def trend(first: float, last: float) -> str:
    change = last / first - 1
    return "flat" if abs(change) < FLAT_BAND else ("grows" if change > 0 else "shrinks")


def _fmt(value: float, percent: bool = False) -> str:
    if not math.isfinite(value):
        return "n/a"
    if percent:
        return f"{100 * value:.1f}%"
    return f"{value:.3g}"


def render_table(summaries: dict[str, Summaries], accuracies: dict[str, float]) -> str:
    """The side-by-side table (final checkpoint vs W0), the over-time trends, and the accuracies."""
    expected_text = {"increasing": "SFT<OPD<RLVR", "decreasing": "SFT>OPD>RLVR", "opd_highest": "OPD highest"}
    head = f"{'diagnostic':28} {'SFT':>9} {'OPD':>9} {'RLVR':>9}  {'paper SFT / OPD / RLVR':34} {'expected':13} held"
    lines = [head, "-" * len(head)]
    for c in COMPARISONS:
        values = [c.value(summaries[m]) for m in METHODS]
        held = "yes" if ordering_held(values, c.expected) else "NO"
        cells = " ".join(f"{_fmt(v, c.percent):>9}" for v in values)
        lines.append(f"{c.label:28} {cells}  {c.paper:34} {expected_text[c.expected]:13} {held}")
    lines += ["", f"{'over time (first -> last)':28} {'SFT':>22} {'OPD':>22} {'RLVR':>22}  paper"]
    for label, key, paper in TRAJECTORIES:
        cells, verdicts = [], []
        for method, expected in zip(METHODS, paper):
            first, last = summaries[method][0]["all"][key], summaries[method][-1]["all"][key]
            seen = trend(first, last)
            cells.append(f"{_fmt(first)}->{_fmt(last)} {seen}")
            verdicts.append("yes" if seen == expected else "NO")
        lines.append(f"{label:28} " + " ".join(f"{c:>22}" for c in cells)
                     + f"  {' / '.join(paper)}; held: {' / '.join(verdicts)}")
    lines += ["", "sampled (T=1) validation accuracy: "
              + ", ".join(f"{name} {value:.3f}" for name, value in accuracies.items())]
    return "\n".join(lines)


# ---- driver --------------------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="training steps per arm (RL steps; SFT matched)")
    parser.add_argument("--checkpoints", type=int, default=5, help="evenly spaced snapshots per arm (divides --steps)")
    parser.add_argument("--lr", type=float, default=1e-5, help="peak learning rate of every arm")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-update-geometry", help="output directory")
    args = parser.parse_args()
    if args.checkpoints < 2 or args.steps % args.checkpoints:
        parser.error("--checkpoints must be >= 2 and divide --steps")
    return args


def main() -> None:
    args = parse_args()
    started = time.time()
    cfg = task_config(args)
    base, teacher = prepare_base_and_teacher(cfg)
    print(f"W0 {base}\nteacher {teacher}", flush=True)

    snapshots = {"SFT": run_sft(cfg, base, args.steps, args.steps // args.checkpoints)}
    for method, algo, extra in (("OPD", "opd", ["--opd.teacher_path", str(teacher)]), ("RLVR", "grpo", [])):
        run_dir = args.out / method.lower()
        run_rl(args, algo, base, run_dir, extra)
        snapshots[method] = run_checkpoints(run_dir)
    trained = time.time()

    w0 = Snapshot("W0", 0, HFCheckpointReader(base))
    summaries = {}
    for method, by_step in snapshots.items():
        later = [Snapshot(f"{method.lower()}_step{step}", step, TensorDictSource(w)) for step, w in by_step.items()]
        summaries[method] = diagnose_sources(w0, later, args.out / method.lower() / "diagnostics", SETTINGS)["checkpoints"]

    val_rows = task_rows(cfg)[1]
    seed = cfg.train.seed
    accuracies = {"W0": accuracy(base, None, val_rows, seed), "teacher": accuracy(teacher, None, val_rows, seed)}
    accuracies.update({m: accuracy(base, snapshots[m][args.steps], val_rows, seed) for m in METHODS})

    table = render_table(summaries, accuracies)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = (f"{stamp}; {args.steps} steps per arm, checkpoints every {args.steps // args.checkpoints}, lr {args.lr}; "
              f"training {trained - started:.0f} s, total {time.time() - started:.0f} s")
    print(f"\n{header}\n{table}")
    (args.out / "table.txt").write_text(f"{header}\n{table}\n")
    (args.out / "summaries.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                         "summaries": summaries, "accuracy": accuracies}, indent=1))


if __name__ == "__main__":
    main()
