"""Arithmetic task and verifier, overlong penalty, reward loading."""

import pytest

from megatron_armor.rewards.arithmetic import make_rows, verify
from megatron_armor.rewards.overlong import overlong_penalty
from megatron_armor.rewards.registry import RewardError, load_reward_fn, score


def test_rows_are_deterministic_distinct_and_solutions_verify():
    rows = make_rows(300, seed=3)
    assert rows == make_rows(300, seed=3)
    assert len({r["prompt"] for r in rows}) == 300
    for row in rows:
        assert verify(row["solution"], row) == (1.0, True)
        assert int(row["answer"]) == eval(row["prompt"][:-1])  # independent evaluation of the expression


def test_verifier_is_strict_and_last_answer_wins():
    row = {"answer": "-3"}
    assert verify("Answer: -3", row) == (1.0, True)
    assert verify("Answer: 5 ... Answer: -3", row) == (1.0, True)
    assert verify("Answer: -3 then Answer: 4", row) == (-1.0, False)
    assert verify("-3", row) == (-1.0, False)
    assert verify("answer: -3", row) == (-1.0, False)


def test_overlong_penalty():
    assert overlong_penalty(10, 40, 8) == 0.0
    assert overlong_penalty(32, 40, 8) == 0.0
    assert overlong_penalty(36, 40, 8) == pytest.approx(-0.5)
    assert overlong_penalty(40, 40, 8, factor=2.0) == pytest.approx(-2.0)
    assert overlong_penalty(40, 40, 0) == 0.0
    with pytest.raises(ValueError):
        overlong_penalty(1, 4, 8)


def test_reward_loading_errors_and_validation():
    fn = load_reward_fn("megatron_armor.rewards.arithmetic:verify")
    assert score(fn, "Answer: 2", {"answer": "2"}) == (1.0, True)
    for bad, match in [("no_colon", "package.module:function"), ("not_a_module_xyz:f", "cannot import"),
                       ("megatron_armor.rewards.arithmetic:missing", "no attribute"),
                       ("megatron_armor.rewards.arithmetic:_ANSWER", "not callable")]:
        with pytest.raises(RewardError, match=match):
            load_reward_fn(bad)
    with pytest.raises(RewardError, match="non-finite"):
        score(lambda r, row: (float("nan"), False), "", {})
    with pytest.raises(RewardError, match="must return"):
        score(lambda r, row: 1.0, "", {})
