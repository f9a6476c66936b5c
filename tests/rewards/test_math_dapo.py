"""DAPO's exact-match verifier (armor.md §5): Minerva-normalized last Answer line vs ground truth, +1 / -1."""

import pytest

from megatron_armor.rewards.math_dapo import normalize_final_answer, verify
from megatron_armor.rewards.registry import load_reward_fn


@pytest.mark.parametrize("raw, normal", [
    ("$\\boxed{34}$", "34"),
    ("1,000", "1000"),  # thousands separators of an integer
    ("\\frac12", "\\frac{1}{2}"),  # TeX shorthand expanded
    ("\\sqrt2", "\\sqrt{2}"),
    ("5 degrees", "5"),  # units dropped
    ("90^\\circ", "90"),
    ("x = 3", "3"),  # the right-hand side of the last "="
    ("\\$18.90", "18.90"),
    ("\\text{(A)}", "(A)"),
    ("$x+1$ and more", "x+1"),  # the first $...$ span
    ("  7 ", "7"),
])
def test_minerva_normalization(raw, normal):
    assert normalize_final_answer(raw) == normal


@pytest.mark.parametrize("response, answer, correct", [
    ("Let me think.\nAnswer: 34", "34", True),
    ("Answer: $\\boxed{34}$", "34", True),
    ("answer: 1,000", "1000", True),  # any case
    ("Answer: \\frac12", "\\frac{1}{2}", True),
    ("Answer: 18", "$18$", True),  # the ground truth is normalized too
    ("Answer: 0.5", "\\frac{1}{2}", False),  # string equality, not value equality (unlike math-verify)
    ("so the result is \\boxed{34}", "34", False),  # no Answer line: wrong, whatever it boxed
    ("Answer: 4\nAnswer: 5", "5", True),  # the last Answer line wins
    ("Answer: 4\nAnswer: 5", "4", False),
    ("Answer: 7" + " and so on" * 40, "7", False),  # the Answer line lies before the last 300 characters
    ("Answer:", "7", False),
])
def test_math_dapo_verify(response, answer, correct):
    assert verify(response, {"answer": answer}) == ((1.0, True) if correct else (-1.0, False))


def test_loads_by_dotted_path_and_takes_numeric_answers():
    fn = load_reward_fn("megatron_armor.rewards.math_dapo:verify")
    assert fn("Answer: 12", {"answer": 12}) == (1.0, True)
