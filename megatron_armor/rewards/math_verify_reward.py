"""Math answers checked with the `math-verify` package (+1 / -1)."""

from __future__ import annotations

import re

_ANSWER = re.compile(r"Answer:\s*(.+)")
_BOXED = "\\boxed"


def verify(response: str, row: dict) -> tuple[float, bool]:
    """Compare the last `Answer: ...` line (or, without one, the last \\boxed{...}) of the response's final
    300 characters with row["answer"]; a response with neither is wrong (not its tail's last number)."""
    from math_verify import parse
    from math_verify import verify as equivalent

    tail = response[-300:]
    matches = _ANSWER.findall(tail)
    answer = matches[-1].strip() if matches else _last_boxed(tail)
    if answer is None:
        return -1.0, False
    gold, predicted = parse(f"${row['answer']}$"), parse(f"${answer}$")
    correct = bool(predicted) and bool(equivalent(gold, predicted))
    return (1.0, True) if correct else (-1.0, False)


def _last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} in `text`, or None (none, or the last one is unclosed)."""
    start = text.rfind(_BOXED)
    if start == -1:
        return None
    i = start + len(_BOXED)
    while i < len(text) and text[i] == " ":
        i += 1
    if i == len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None
