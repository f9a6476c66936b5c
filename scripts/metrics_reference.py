"""Fixed-seed short runs whose `metrics.jsonl` must not change under refactoring, on any x86-64 CPU.

Each case is an `armor train` command line (the demo config, and short runs of the other algorithms);
`record` stores its metrics (every key but the `perf/*` timings) under tests/data/metrics_reference/,
`check` runs the cases again and compares, and `check-pins` runs `PINS_CASES` twice, the second time as if on another
CPU (`OTHER_CPU`), and requires the same bits.

Every run has the numerical environment `PORTABLE_NUMERICS` (each pin's reason is beside it): without it a run's
floats depend on the CPU's instruction set, and RL sampling turns a last-bit difference into other samples from
step 0 on. Counts must match the reference exactly; floats to a relative 1e-5 (under the pins they are the same
bits on any x86-64 CPU; the tolerance only keeps the reports of a real change short of last-bit noise), while
`check-pins` compares with ==.

    .venv/bin/python scripts/metrics_reference.py check            # every case
    .venv/bin/python scripts/metrics_reference.py check-pins       # as if on another CPU: the same bits?
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

# The numerical environment of every case: with it a case writes the same bits on any x86-64 CPU (a sample recorded
# on an Intel Xeon with AVX-512 was reproduced byte for byte by another run; without the pins that machine's results
# differed from an AMD EPYC's from step 0 on). The variables are read when the libraries load, so they reach the
# `armor train` process and the ranks torchrun starts through the environment, not through torch calls.
PORTABLE_NUMERICS: dict[str, str] = {
    # MKL (every float32 matmul on CPU) chooses its kernels, and with them the summation order, by instruction set
    # and CPU vendor; the COMPATIBLE branch of its conditional numerical reproducibility is one SSE2 code path on
    # every x86-64 CPU.
    "MKL_CBWR": "COMPATIBLE",
    # ATen's vectorised kernels (sums, softmax, exp/log, ...) are compiled per capability (default, avx2, avx512) and
    # one is chosen at start-up: an AVX-512 sum adds 16 lanes at a time, AVX2 8. 'default' is the build any x86-64
    # CPU runs (measured: ATEN_CPU_CAPABILITY=avx2 instead of default changes grpo_kl's metrics).
    "ATEN_CPU_CAPABILITY": "default",
    # oneDNN JIT-compiles for the widest instruction set it finds; it runs the rollout engine's prepacked linear
    # layers (rollout/prepacked_linear.py) and bf16 matmuls. The tiny models' layers are below the prepack size, so
    # no case reaches it today; the pin keeps a case that does portable. SSE4.1: every x86-64 CPU since 2011.
    "ONEDNN_MAX_CPU_ISA": "SSE41",
    # Parallel reductions split the work by thread count (ATen's OpenMP threads, MKL's own): one thread each.
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    # glibc picks FMA (or AMD's FMA4) versions of libm's exp, log, pow, sin, ... where the CPU has them, and they
    # round some results otherwise than the SSE2 versions every x86-64 CPU runs (measured: opd's grad norm moves in its
    # last bit when this mask is left out on an FMA CPU); the mask makes glibc take the SSE2 ones.
    "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2,-FMA,-FMA4",
}
# What another CPU would change and the pins must make irrelevant, all at once in `check-pins`' second run: MKL
# limited to SSE4.2 kernels (an AVX2 machine's own would differ without MKL_CBWR), and glibc's other CPU-specific
# variants (string functions, SSE4.1 rounding) as on a CPU without AVX, AVX-512 or SSE4.x, over the pinned mask.
OTHER_CPU: dict[str, str] = {
    "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2,-FMA,-FMA4,-AVX,-AVX512F,-SSE4_1,-SSE4_2",
}
# The cases `check-pins` runs (short; their model and warm start made afresh under OTHER_CPU): GRPO + KL and OPD,
# whose teacher-scored advantages take other code paths.
PINS_CASES = ("grpo_kl", "opd")

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
CASES["grpo_kl_on_policy_packed"] = [*CASES["grpo_kl_on_policy"], "--micro_batching.max_tokens", "96",
                                     "--micro_batching.pack", "true"]
REFERENCE_OF = {"grpo_kl_on_policy_packed": "grpo_kl_on_policy"}  # case -> the case whose reference it is held to
RECORD_ONLY = ("grpo_kl_on_policy",)  # recorded, not run by `check` (nor the test suite): another case is held to it


def checked_cases() -> list[str]:
    """The cases `check` runs by default, and the test suite."""
    return [name for name in CASES if name not in RECORD_ONLY]


def run_case(name: str, work_dir: Path, cache_dir: Path, *, environment: dict[str, str] | None = None) -> list[dict]:
    """Run case `name` with `armor train` in a fresh run directory, under `PORTABLE_NUMERICS` and then
    `environment`; its metrics rows without perf/*. A `cache_dir` without the synthetic task's model and warm start
    makes them in the same process, under the same environment."""
    run_dir = work_dir / name
    cmd = [str(Path(sys.executable).parent / "armor"), "train", *CASES[name], "--run-dir", str(run_dir),
           "--task.cache_dir", str(cache_dir), *_QUIET]
    env = {**os.environ, **PORTABLE_NUMERICS, "TOKENIZERS_PARALLELISM": "false", **(environment or {})}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"case {name} failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-6000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in rows]


def differences(expected: list[dict], actual: list[dict], *, exact: bool = False) -> list[str]:
    """Human-readable differences between two metric logs ([] when they agree): floats within a relative 1e-5, or
    with `exact` the same bits."""
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
            same = _same_value(value, other) or (not exact and isinstance(value, float) and isinstance(other, float)
                                                 and math.isclose(value, other, rel_tol=1e-5, abs_tol=1e-7))
            if not same:
                out.append(f"step {want['step']}: {key} = {other!r}, reference {value!r}")
    return out


def _same_value(a, b) -> bool:
    """a == b, NaN equal to NaN (a skipped update may log one)."""
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def other_cpu_differences(work_dir: Path, baselines: dict[str, list[dict]] | None = None) -> list[str]:
    """Run `PINS_CASES` under the pins with `OTHER_CPU`'s settings, the synthetic task's model and warm start made
    afresh under them (one cache); their differences, bit for bit, from `baselines` (case -> rows; default: the
    cases run under the pins alone, also from a fresh cache), each prefixed by its case."""
    if baselines is None:
        baselines = {case: run_case(case, work_dir / "pinned", work_dir / "pinned-cache") for case in PINS_CASES}
    out = []
    for case in PINS_CASES:
        other = run_case(case, work_dir / "other-cpu", work_dir / "other-cpu-cache", environment=OTHER_CPU)
        out += [f"{case}: {line}" for line in differences(baselines[case], other, exact=True)]
    return out


def reference_path(name: str) -> Path:
    return REFERENCE_DIR / f"{REFERENCE_OF.get(name, name)}.jsonl"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["check", "record", "check-pins"])
    parser.add_argument("cases", nargs="*", help=f"cases to run (default: all of {list(CASES)}; check-pins: "
                                                 f"{list(PINS_CASES)}, always)")
    args = parser.parse_args(argv)
    if args.action == "check-pins":
        if args.cases:
            parser.error(f"check-pins runs {list(PINS_CASES)} and takes no cases")
        with tempfile.TemporaryDirectory() as tmp:
            diffs = other_cpu_differences(Path(tmp))
        verdict = "the same bits" if not diffs else "DIFFERS\n  " + "\n  ".join(diffs[:20])
        print(f"{list(PINS_CASES)} with {OTHER_CPU}: {verdict}")
        return 1 if diffs else 0
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
