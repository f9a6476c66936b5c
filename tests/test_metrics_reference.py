"""Behaviour is pinned: fixed-seed short runs of every built-in algorithm (the demo config for 10 steps among
them) write the metrics stored in tests/data/metrics_reference/ (scripts/metrics_reference.py), on any x86-64 CPU:
the runs' numerical environment is pinned (`PORTABLE_NUMERICS`), and a run as if on another CPU must give the same
bits, so a change that adds a CPU-dependent path the pins do not cover fails here and not on a user's machine."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "scripts" / "metrics_reference.py"
_spec = importlib.util.spec_from_file_location("metrics_reference", SCRIPT)
metrics_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(metrics_reference)


def test_differences_sees_a_changed_value_a_missing_key_and_a_missing_step():
    rows = [{"step": 0, "a": 1.0, "n": 3}, {"step": 1, "a": 2.0, "n": 4}]
    assert metrics_reference.differences(rows, [dict(r) for r in rows]) == []
    assert metrics_reference.differences(rows, [rows[0], {**rows[1], "a": 2.0 * (1 + 1e-7)}]) == []  # last bits
    assert metrics_reference.differences(rows, [rows[0], {**rows[1], "a": 2.001}]) == ["step 1: a = 2.001, reference 2.0"]
    assert metrics_reference.differences(rows, [rows[0], {**rows[1], "n": 5}]) == ["step 1: n = 5, reference 4"]
    assert "missing ['a']" in metrics_reference.differences(rows, [rows[0], {"step": 1, "n": 4}])[0]
    assert metrics_reference.differences(rows, rows[:1])


def test_exact_differences_see_the_last_bit_and_take_nan_as_equal():
    rows = [{"step": 1, "a": 2.0, "g": float("nan")}]
    assert metrics_reference.differences(rows, [{"step": 1, "a": 2.0, "g": float("nan")}], exact=True) == []
    last_bit = [{"step": 1, "a": 2.0 * (1 + 2**-52), "g": float("nan")}]
    assert metrics_reference.differences(rows, last_bit) == []
    assert metrics_reference.differences(rows, last_bit, exact=True) == [f"step 1: a = {2.0 * (1 + 2**-52)!r}, "
                                                                        f"reference 2.0"]


@pytest.fixture(scope="module")
def pinned_run(synthetic_cache, tmp_path_factory):
    """pinned_run(case): the case's metrics rows under the pins (run once per module; every case shares one cache,
    whose model and warm start the first case makes under the same pins)."""
    rows: dict[str, list[dict]] = {}

    def run(case: str) -> list[dict]:
        if case not in rows:
            rows[case] = metrics_reference.run_case(case, tmp_path_factory.mktemp(case),
                                                    synthetic_cache / "metrics-reference")
        return rows[case]

    return run


@pytest.mark.parametrize("case", metrics_reference.checked_cases())
def test_fixed_seed_run_writes_the_reference_metrics(case, pinned_run):
    expected = [json.loads(line) for line in metrics_reference.reference_path(case).read_text().splitlines()]
    assert metrics_reference.differences(expected, pinned_run(case)) == []


def test_a_pinned_run_as_if_on_another_cpu_gives_the_same_bits(pinned_run, tmp_path):
    """The pins neutralise the instruction set: `PINS_CASES` with `OTHER_CPU`'s settings (MKL's SSE4.2 kernels,
    glibc as on a CPU without AVX or SSE4), their model and warm start made afresh under them, write exactly (==, not
    within a tolerance) the metrics of the pinned runs on this machine."""
    baselines = {case: pinned_run(case) for case in metrics_reference.PINS_CASES}
    assert metrics_reference.other_cpu_differences(tmp_path, baselines) == []
