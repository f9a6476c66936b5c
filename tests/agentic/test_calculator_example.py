"""The environment of examples/tiny/agentic.yaml (megatron_armor/agentic/examples.py) and its warm start's tool
demonstrations: the calculator against Python's own arithmetic, an episode through the environment, and the
demonstration rendered by the example's chat template with exactly the assistant turns trained."""

import asyncio
from pathlib import Path

import pytest

from megatron_armor.agentic.examples import CalculatorArithmetic, calculator
from megatron_armor.agentic.tools import tool_calls_text
from megatron_armor.models.tiny import make_char_tokenizer
from megatron_armor.rewards.arithmetic import make_rows
from megatron_armor.trainer.run.warmstart import ToolDemonstrations

TEMPLATE = Path(__file__).parents[2] / "examples" / "tiny" / "calculator_chat.jinja"
ENVIRONMENT = "megatron_armor.agentic.examples:CalculatorArithmetic"


@pytest.mark.parametrize("expression", ["3+5-2+7-1", "9-9-9-9-9-9", "(2+3)*4", "-4*-2", "0"])
def test_calculator_evaluates_integer_arithmetic(expression):
    assert calculator(expression) == str(eval(expression))  # noqa: S307 (the independent reference)


@pytest.mark.parametrize("expression", ["2**10", "__import__('os')", "3/2", "4+", "x"])
def test_calculator_answers_what_it_does_not_evaluate_with_an_error(expression):
    assert calculator(expression).startswith("error: ")


def test_episode_calls_the_calculator_and_scores_the_last_answer():
    row = make_rows(1, seed=0, min_terms=6, max_terms=6)[0]
    env = CalculatorArithmetic()
    assert [t["function"]["name"] for t in env.tools] == ["calculator"]
    messages = env.reset(row)
    call = {"role": "assistant", "content": tool_calls_text([("calculator", {"expression": row["prompt"][:-1]})])}
    reply = asyncio.run(env.step([*messages, call]))
    assert reply.tool_calls == 1 and not reply.done and reply.messages == [{"role": "tool", "content": row["answer"]}]
    answer = {"role": "assistant", "content": f"Answer: {row['answer']}"}
    assert asyncio.run(env.step([*messages, call, *reply.messages, answer])).done
    assert env.score([*messages, call, *reply.messages, answer]) == 1.0
    wrong = {"role": "assistant", "content": f"Answer: {int(row['answer']) + 1}"}
    assert env.score([*messages, call, *reply.messages, wrong]) == -1.0
    assert env.score([*messages, call, *reply.messages]) == -1.0  # ended before answering


def test_demonstration_trains_the_assistant_turns_only():
    tokenizer = make_char_tokenizer()
    tokenizer.chat_template = TEMPLATE.read_text()
    row = {"prompt": "3+5-2+7-1=", "answer": "12"}
    example = ToolDemonstrations(tokenizer, ENVIRONMENT).example(row)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "3+5-2+7-1"}}</tool_call>'
    eos = "<|endoftext|>"
    pieces = [("tools: calculator \n3+5-2+7-1=", False), (call + eos, True), ("->12\n", False),
              ("Answer: 12" + eos, True)]
    assert tokenizer.decode(example.token_ids) == "".join(text for text, _ in pieces)
    assert example.trained == [trained for text, trained in pieces for _ in tokenizer.encode(text)]


def test_demonstrations_need_an_environment_that_has_them():
    tokenizer = make_char_tokenizer()
    tokenizer.chat_template = TEMPLATE.read_text()
    two_turns = f"{Path(__file__).parents[1] / 'trainer' / 'agentic_task' / 'two_turns.py'}:TwoTurnArithmetic"
    with pytest.raises(ValueError, match="no demonstration"):
        ToolDemonstrations(tokenizer, two_turns)
