"""The environment of `examples/tiny/agentic.yaml`: the synthetic arithmetic task (rewards/arithmetic.py) where the
policy may call a `calculator` tool, and the demonstration its supervised warm start is shown.

An episode: the user message is the problem ("3+5-2+7="); the policy calls
`<tool_call>{"name": "calculator", "arguments": {"expression": "3+5-2+7"}}</tool_call>`, reads the result (a "tool"
message) and answers "Answer: 13"; a turn without a tool call ends the episode. The reward is the arithmetic
verifier's on the last assistant message: +1 when its final `Answer: <int>` is right, else -1.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_armor.agentic.environment import Message
from megatron_armor.agentic.tool_env import ToolEnv
from megatron_armor.agentic.tools import Tool, tool_calls_text
from megatron_armor.rewards.arithmetic import verify

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg}
CALCULATOR_PARAMETERS = {
    "type": "object",
    "properties": {"expression": {"type": "string", "description": "integers with + - * and parentheses"}},
    "required": ["expression"],
}


def calculator(expression: str) -> str:
    """Evaluate an integer expression of + - * and parentheses; a malformed one is answered with "error: ..." (the
    policy's mistake, told to it: the trajectory goes on)."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not allowed: {ast.unparse(node)}")

    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, RecursionError) as error:
        return f"error: {error}"


class CalculatorArithmetic(ToolEnv):
    """The arithmetic task with the `calculator` tool offered (module docstring). Rows: {"prompt", "answer"}."""

    def __init__(self) -> None:
        super().__init__([Tool(calculator, CALCULATOR_PARAMETERS, timeout_s=2.0)])

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        self.row = row
        return [{"role": "user", "content": row["prompt"]}]

    def score(self, messages: Sequence[Message]) -> float:
        return verify(messages[-1]["content"], self.row)[0] if messages[-1]["role"] == "assistant" else -1.0

    def demonstration(self, row: Mapping[str, Any]) -> list[Message]:
        """A solved episode of `row` for the warm start: the problem, the calculator called on its expression, the
        tool's result, the answer."""
        expression = row["prompt"].removesuffix("=")
        return [*self.reset(row),
                {"role": "assistant", "content": tool_calls_text([("calculator", {"expression": expression})])},
                {"role": "tool", "content": calculator(expression)},
                {"role": "assistant", "content": f"Answer: {row['answer']}"}]
