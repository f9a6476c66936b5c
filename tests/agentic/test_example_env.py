"""The guides' environments (examples/agentic/), loaded by their paths as a config names them."""

from __future__ import annotations

from pathlib import Path

from agentic_helpers import PolicyByPrompt, play
from megatron_armor.agentic.chat_templates import make_chat_tokenizer
from megatron_armor.agentic.environment import load_environment
from megatron_armor.agentic.tools import tool_calls_text
from megatron_armor.agentic.trajectory import Status

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "agentic"


def test_calculator_env_answers_tool_calls_and_scores_the_answer():
    env = load_environment(f"{EXAMPLES / 'calculator_env.py'}:CalculatorEnv")
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


def test_python_math_env_runs_the_policy_s_code_in_the_sandbox_and_scores_the_last_answer_line():
    """The own-task guide's environment: a python tool call's printed output comes back as the tool message."""
    env = load_environment(f"{EXAMPLES / 'python_math_env.py'}:PythonMathEnv")
    tokenizer = make_chat_tokenizer("chatml")
    stop_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    call = tool_calls_text([("python", {"code": "print(sum(range(1, 101)))"})])
    policy = PolicyByPrompt(tokenizer, stop_id, {"1..100": [call, "So Answer: 5050"], "2+2": ["Answer: 5"]})
    rows = [{"prompt": "1..100", "answer": 5050}, {"prompt": "2+2", "answer": 4}]
    right, wrong = play(policy, tokenizer, stop_id, make_env=env, rows=rows, max_in_flight=2)
    assert [m["content"] for m in right.messages if m["role"] == "tool"] == ["5050\n"]  # what it printed
    assert (right.status, right.reward, right.stats.tool_calls) == (Status.COMPLETED, 1.0, 1)
    assert (wrong.status, wrong.reward, wrong.stats.tool_calls) == (Status.COMPLETED, 0.0, 0)
