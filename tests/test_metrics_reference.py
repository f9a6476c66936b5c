"""Behaviour is pinned: fixed-seed short runs of every built-in algorithm (the demo config for 10 steps among
them) write the metrics stored in tests/data/metrics_reference/ (scripts/metrics_reference.py)."""

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


@pytest.mark.parametrize("case", metrics_reference.checked_cases())
def test_fixed_seed_run_writes_the_reference_metrics(case, tmp_path, synthetic_cache):
    rows = metrics_reference.run_case(case, tmp_path, synthetic_cache / "metrics-reference")
    expected = [json.loads(line) for line in metrics_reference.reference_path(case).read_text().splitlines()]
    assert metrics_reference.differences(expected, rows) == []
