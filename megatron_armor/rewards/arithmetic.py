"""Synthetic verifiable task: left-to-right chains of single-digit additions and subtractions.

A row is {"prompt": "3+5-2=", "answer": "6", "solution": "3+5=8,8-2=6 Answer: 6"}; the solution
(shown step by step) is the supervised warm-start target, the verifier checks only the final answer.
"""

from __future__ import annotations

import random
import re

_ANSWER = re.compile(r"Answer: (-?\d+)")


def make_rows(num_rows: int, seed: int, min_terms: int = 2, max_terms: int = 3) -> list[dict]:
    """`num_rows` distinct problems with min_terms..max_terms operands (deterministic in `seed`).

    Different seeds give independent draws; a problem may appear in both a train and a val set.
    """
    if not 2 <= min_terms <= max_terms:
        raise ValueError(f"need 2 <= min_terms <= max_terms, got {min_terms}, {max_terms}")
    rng = random.Random(seed)
    rows, seen = [], set()
    capacity = sum(10 * 20 ** (k - 1) for k in range(min_terms, max_terms + 1))
    if num_rows > capacity:
        raise ValueError(f"only {capacity} distinct problems exist with {min_terms}-{max_terms} terms, asked {num_rows}")
    while len(rows) < num_rows:
        terms = [rng.randrange(10) for _ in range(rng.randint(min_terms, max_terms))]
        ops = [rng.choice("+-") for _ in terms[1:]]
        prompt = str(terms[0]) + "".join(f"{op}{t}" for op, t in zip(ops, terms[1:])) + "="
        if prompt in seen:
            continue
        seen.add(prompt)
        value, steps = terms[0], []
        for op, term in zip(ops, terms[1:]):
            new = value + term if op == "+" else value - term
            steps.append(f"{value}{op}{term}={new}")
            value = new
        rows.append({"prompt": prompt, "answer": str(value), "solution": ",".join(steps) + f" Answer: {value}"})
    return rows


def extract_answer(response: str) -> str | None:
    """The integer of the last `Answer: <int>` in the final 300 characters, as `verify` reads it (None: none)."""
    matches = _ANSWER.findall(response[-300:])
    return str(int(matches[-1])) if matches else None


def verify(response: str, row: dict) -> tuple[float, bool]:
    """Strict verifier: the last `Answer: <int>` in the final 300 characters must equal the answer.

    Returns (1.0, True) when correct and (-1.0, False) otherwise (also when no answer is given).
    """
    answer = extract_answer(response)
    correct = answer is not None and int(answer) == int(row["answer"])
    return (1.0, True) if correct else (-1.0, False)
