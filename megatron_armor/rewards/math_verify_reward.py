"""Math answers checked with the `math-verify` package (+1 / -1)."""

from __future__ import annotations

import re

_ANSWER = re.compile(r"Answer:\s*(.+)")


def verify(response: str, row: dict) -> tuple[float, bool]:
    """Compare the last `Answer: ...` line (or \\boxed{...}) of the response with row["answer"]."""
    from math_verify import parse
    from math_verify import verify as equivalent

    tail = response[-300:]
    matches = _ANSWER.findall(tail)
    candidate = f"${matches[-1].strip()}$" if matches else tail
    gold, predicted = parse(f"${row['answer']}$"), parse(candidate)
    correct = bool(predicted) and bool(equivalent(gold, predicted))
    return (1.0, True) if correct else (-1.0, False)
