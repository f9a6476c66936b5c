"""A calculator tool environment (docs/guides/agentic.md): the policy may call `calculate` before it answers;
the reward is 1 when its last message holds the row's answer. Named examples/agentic/calculator_env.py:CalculatorEnv"""
import ast
import operator

from megatron_armor.agentic.tool_env import ToolEnv
from megatron_armor.agentic.tools import Tool

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """Evaluate an integer expression of + - * and parentheses."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, (ast.BinOp, ast.UnaryOp)) and type(node.op) in OPERATORS:
            args = (node.left, node.right) if isinstance(node, ast.BinOp) else (node.operand,)
            return OPERATORS[type(node.op)](*map(value, args))
        raise ValueError(f"not allowed: {ast.unparse(node)}")
    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError) as error:  # the policy's mistake: told to it, the trajectory goes on
        return f"error: {error}"


class CalculatorEnv(ToolEnv):
    def __init__(self):
        schema = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
        super().__init__([Tool(calculate, schema, timeout_s=2.0)])

    def reset(self, row):
        self.answer = str(row["answer"])
        return [{"role": "system", "content": "Use the calculator, then state the result."},
                {"role": "user", "content": row["prompt"]}]

    def score(self, messages):
        return float(self.answer in messages[-1]["content"])
