"""The default reward (math-verify, +1 / -1) and the rollout scorer that applies it with the overlong penalty."""

import pytest

from megatron_armor.config import RewardConfig
from megatron_armor.data.datasets import PromptRow
from megatron_armor.models.tiny import make_char_tokenizer
from megatron_armor.rewards.math_verify_reward import verify
from megatron_armor.trainer.rollouts.samples import SampleScorer


@pytest.mark.parametrize("response, answer, correct", [
    ("so Answer: 1/2", "0.5", True),  # equal values in different forms
    ("thus \\boxed{\\frac{1}{2}}", "1/2", True),  # no Answer line: the boxed expression of the tail
    ("Answer: \\sqrt{4}", "2", True),
    ("Answer: 3", "4", False),
    ("no idea", "4", False),
    ("Answer: 4\nwait, Answer: 5", "5", True),  # the last Answer line wins
    ("Answer: 4\nwait, Answer: 5", "4", False),
    ("Answer: 7" + " and so on" * 40, "7", False),  # the answer lies before the last 300 characters
    # Without an Answer line only a \boxed{} counts, not the tail's last number (a truncated or unfinished
    # response that merely mentions the answer is wrong, as DAPO's math_dapo verifier scores it: armor.md §5).
    ("so x = 7 and y = 3", "3", False),
    ("we get 3. But wait, that is wrong, let me recompute", "3", False),
    ("The final answer is $\\boxed{\\dfrac{\\sqrt{3}}{2}}$.", "\\frac{\\sqrt{3}}{2}", True),  # nested braces
    ("first \\boxed{5}, no: \\boxed{6}", "6", True),  # the last boxed wins
    ("first \\boxed{5}, no: \\boxed{6}", "5", False),
    ("\\boxed{5} hmm, actually \\boxed{\\frac{6", "5", False),  # the last boxed is cut off: no answer
])
def test_math_verify_reward(response, answer, correct):
    assert verify(response, {"answer": answer}) == ((1.0, True) if correct else (-1.0, False))


def test_sample_scorer_strips_the_stop_token_and_adds_the_overlong_penalty():
    tokenizer = make_char_tokenizer()
    text = "Answer: 12"
    ids = tokenizer.encode(text, add_special_tokens=False)
    eos = tokenizer.eos_token_id
    prompt = PromptRow(index=3, prompt_ids=[1, 2], row={"answer": "12"})
    scorer = SampleScorer(tokenizer, verify, RewardConfig(overlong_buffer=4), max_response_length=len(ids) + 2)

    stopped = scorer(prompt, ids + [eos], [-0.5] * (len(ids) + 1), "stop", is_anchor=True)
    # L = len(ids) + 1 of Lmax = len(ids) + 2 with a 4-token buffer: -(L - (Lmax - 4)) / 4 = -3/4
    assert stopped.reward == pytest.approx(1.0 - 0.75) and stopped.correct and stopped.is_anchor
    assert stopped.prompt_index == 3 and stopped.response_ids == ids + [eos]

    truncated = scorer(prompt, ids[:-1], [-0.5] * (len(ids) - 1), "length", is_anchor=False)
    assert truncated.reward == pytest.approx(-1.0 - 0.25) and not truncated.correct  # "Answer: 1" != 12
