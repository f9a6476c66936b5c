"""The guide's calculator environment (examples/agentic/calculator_env.py), loaded by its path as a config names it."""

from __future__ import annotations

from pathlib import Path

from agentic_helpers import PolicyByPrompt, play
from megatron_armor.agentic.chat_templates import make_chat_tokenizer
from megatron_armor.agentic.environment import load_environment
from megatron_armor.agentic.tools import tool_calls_text
from megatron_armor.agentic.trajectory import Status

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agentic" / "calculator_env.py"


def test_calculator_env_answers_tool_calls_and_scores_the_answer():
    env = load_environment(f"{EXAMPLE}:CalculatorEnv")
    tokenizer = make_chat_tokenizer("llama3")
    stop_id = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    call = tool_calls_text([("calculate", {"expression": "(17 - 5) * -3 + 2"})])
    policy = PolicyByPrompt(tokenizer, stop_id, {
        "12*3": [call, "It is -34."], "7-9": [call, "It is 5."],
        "2**8": [tool_calls_text([("calculate", {"expression": "2**8"})]), "It is 256."],
    })
    rows = [{"prompt": "12*3", "answer": -34}, {"prompt": "7-9", "answer": -2}, {"prompt": "2**8", "answer": 256}]
    right, wrong, corrected = play(policy, tokenizer, stop_id, make_env=env, rows=rows, max_in_flight=3)
    assert [m["content"] for m in right.messages if m["role"] == "tool"] == [str((17 - 5) * -3 + 2)]
    assert (right.status, right.reward, wrong.reward) == (Status.COMPLETED, 1.0, 0.0)
    assert [m["content"] for m in corrected.messages if m["role"] == "tool"] == ["error: not allowed: 2 ** 8"]
    assert (corrected.status, corrected.reward) == (Status.COMPLETED, 1.0)
