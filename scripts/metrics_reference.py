"""Fixed-seed short runs whose `metrics.jsonl` must not change under refactoring.

Each case is an `armor train` command line (the demo config, and short runs of the other algorithms);
`record` stores its metrics (every key but the `perf/*` timings) under tests/data/metrics_reference/,
`check` runs the cases again and compares. Counts must match exactly; floats to a relative 1e-5, so that
another CPU's last-bit differences in a reduction do not fail the check (a real change of behaviour moves
the metrics by far more).

    .venv/bin/python scripts/metrics_reference.py check            # every case
    .venv/bin/python scripts/metrics_reference.py record armor_demo  # after a deliberate change of behaviour
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_DIR = ROOT / "tests" / "data" / "metrics_reference"
_QUIET = ["--logging.tensorboard", "false", "--logging.progress_bar", "false", "--logging.plot", "false"]
_SHORT = ["--eval.every", "0", "--eval.before_train", "false", "--checkpoint.every", "100", "--tp", "1"]

CASES: dict[str, list[str]] = {
    # The README's demo (ARMOR, TP 2 on two processes) for 10 steps, as the restructuring issue asks.
    "armor_demo": ["--config", "examples/tiny/armor.yaml", "--max-steps", "10"],
    "grpo_kl": ["--config", "examples/tiny/armor.yaml", "--max-steps", "2", "--algo", "grpo_kl",
                "--rollout.sampling.actor_n", "8", *_SHORT],
    "mipu": ["--config", "examples/tiny/mipu.yaml", "--max-steps", "2", *_SHORT],
    "opd": ["--config", "examples/tiny/opd.yaml", "--max-steps", "2", *_SHORT],
}
# One mini-batch per RL step (the update is exactly on-policy), recorded before the update's own forward took over
# the separate old-policy pass (issue 18) and before token-budget micro-batches and packing existed (issue 17). It
# now runs with both: skipping that pass and computing no padding token must not change a metric.
CASES["grpo_kl_on_policy"] = [*CASES["grpo_kl"], "--train.mini_batch_size", "8"]
CASES["grpo_kl_on_policy_packed"] = [*CASES["grpo_kl_on_policy"], "--train.max_tokens_per_micro_batch", "96",
                                     "--train.pack_sequences", "true"]
REFERENCE_OF = {"grpo_kl_on_policy_packed": "grpo_kl_on_policy"}  # case -> the case whose reference it is held to
RECORD_ONLY = ("grpo_kl_on_policy",)  # recorded, not run by `check` (nor the test suite): another case is held to it


def checked_cases() -> list[str]:
    """The cases `check` runs by default, and the test suite."""
    return [name for name in CASES if name not in RECORD_ONLY]


def run_case(name: str, work_dir: Path, cache_dir: Path) -> list[dict]:
    """Run case `name` with `armor train` in a fresh run directory; its metrics rows without perf/*."""
    run_dir = work_dir / name
    cmd = [str(Path(sys.executable).parent / "armor"), "train", *CASES[name], "--run-dir", str(run_dir),
           "--task.cache_dir", str(cache_dir), *_QUIET]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"case {name} failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-6000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in rows]


def differences(expected: list[dict], actual: list[dict]) -> list[str]:
    """Human-readable differences between two metric logs ([] when they agree)."""
    if [r["step"] for r in expected] != [r["step"] for r in actual]:
        return [f"steps {[r['step'] for r in expected]} != {[r['step'] for r in actual]}"]
    out = []
    for want, got in zip(expected, actual):
        if want.keys() != got.keys():
            out.append(f"step {want['step']}: keys differ: missing {sorted(want.keys() - got.keys())}, "
                       f"extra {sorted(got.keys() - want.keys())}")
            continue
        for key, value in want.items():
            other = got[key]
            same = (math.isclose(value, other, rel_tol=1e-5, abs_tol=1e-7) if isinstance(value, float)
                    else value == other)
            if not same:
                out.append(f"step {want['step']}: {key} = {other!r}, reference {value!r}")
    return out


def reference_path(name: str) -> Path:
    return REFERENCE_DIR / f"{REFERENCE_OF.get(name, name)}.jsonl"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["check", "record"])
    parser.add_argument("cases", nargs="*", help=f"cases to run (default: all of {list(CASES)})")
    args = parser.parse_args(argv)
    names = args.cases or (checked_cases() if args.action == "check" else [n for n in CASES if n not in REFERENCE_OF])
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {list(CASES)}")
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            rows = run_case(name, Path(tmp) / "runs", Path(tmp) / "cache")
            if args.action == "record" and name in REFERENCE_OF:
                print(f"{name}: held to {REFERENCE_OF[name]}'s reference, nothing to record")
                continue
            if args.action == "record":
                REFERENCE_DIR.mkdir(parents=True, exist_ok=True)
                reference_path(name).write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
                print(f"{name}: recorded {len(rows)} rows in {reference_path(name).relative_to(ROOT)}")
                continue
            expected = [json.loads(line) for line in reference_path(name).read_text().splitlines()]
            diffs = differences(expected, rows)
            print(f"{name}: " + ("same as the reference" if not diffs else "DIFFERS\n  " + "\n  ".join(diffs[:20])))
            failed |= bool(diffs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
