"""The estimators against independent references: pass@k against enumerating every k-subset of the n samples,
maj@k with ties broken as documented, the bootstrap standard error reproducible from its seed."""

import itertools
import math

import numpy as np
import pytest

from megatron_armor.evaluation.estimators import (
    bootstrap_stderr, maj_at_k, majority_answer, mean_pass_at_k, pass_at_k,
)


def brute_force_pass_at_k(verdicts: list[bool], k: int) -> float:
    """The share of all k-subsets of the samples holding at least one correct one."""
    subsets = list(itertools.combinations(verdicts, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_pass_at_k_equals_enumeration_over_all_subsets(n):
    for c in range(n + 1):
        verdicts = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(verdicts, k), abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_for_large_n():
    # C(1000, 500) overflows a float; the product form still gives the closed form's value
    assert pass_at_k(1000, 1, 500) == pytest.approx(0.5, abs=1e-12)
    assert pass_at_k(1000, 0, 10) == 0.0
    assert pass_at_k(1000, 995, 10) == 1.0
    expected = 1 - math.comb(60, 16) / math.comb(64, 16)
    assert pass_at_k(64, 4, 16) == pytest.approx(expected, rel=1e-12)


def test_pass_at_k_refuses_k_larger_than_n():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)


def test_mean_pass_at_k_averages_prompts():
    rows = [[True, False, False, False], [False, False, False, False], [True, True, False, True]]
    expected = np.mean([brute_force_pass_at_k(r, 2) for r in rows])
    assert mean_pass_at_k(rows, 2) == pytest.approx(expected, abs=1e-12)
    assert mean_pass_at_k(rows, 1) == pytest.approx(np.mean([np.mean(r) for r in rows]), abs=1e-12)


def test_majority_ties_go_to_the_first_answer_in_sample_order():
    assert majority_answer(["3", "5", "5", "3"]) == "3"  # 2-2 tie: "3" came first
    assert majority_answer(["5", "3", "3", "5"]) == "5"
    assert majority_answer([None, None, "7"]) == "7"  # no answer never votes
    assert majority_answer(["1", "2", "2"]) == "2"
    assert majority_answer([None, None]) is None


def test_maj_at_k():
    answers = [["3", "5", "5", "3"], ["5", "3", "3", "5"], [None, None, None, "9"], [None, None, None, None]]
    correct = [[True, False, False, True], [False, True, True, False], [False, False, False, True], [False] * 4]
    # k=4: prompt 0 ties -> "3" (correct); prompt 1 ties -> "5" (wrong); prompt 2 -> "9" (correct); prompt 3: none
    assert maj_at_k(answers, correct, 4) == 0.5
    # k=2: prompt 0 "3"/"5" tie -> "3" correct; prompt 1 -> "5" wrong; prompt 2 no answer; prompt 3 none
    assert maj_at_k(answers, correct, 2) == 0.25
    # k=1 is the first sample's correctness
    assert maj_at_k(answers, correct, 1) == 0.25


def test_bootstrap_stderr_reproducible_from_its_seed():
    values = np.random.default_rng(0).random(50).tolist()
    first, again = bootstrap_stderr(values, seed=7), bootstrap_stderr(values, seed=7)
    assert first == again
    assert bootstrap_stderr(values, seed=8) != first
    analytic = np.std(values, ddof=1) / np.sqrt(len(values))  # the bootstrap estimates this
    assert abs(first - analytic) < 0.15 * analytic
    assert bootstrap_stderr([0.5], seed=1) == 0.0
