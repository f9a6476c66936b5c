"""The per-dataset estimators over prompts that were each sampled n times.

avg@k: the mean correctness of all samples, with a bootstrap standard error (prompts resampled with
replacement by a seeded generator, so a seed reproduces it). pass@k: the unbiased estimator of Chen et al.
(2021), 1 - C(n - c, k) / C(n, k) for a prompt with c correct of n samples, averaged over prompts. maj@k: the
correctness of the most common extracted answer among a prompt's first k samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import mean

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c of them correct) is
    correct: 1 - C(n - c, k) / C(n, k), as the product prod_{i = n-c+1}^{n} (1 - k / i), which neither
    overflows nor cancels (Chen et al. 2021, Codex paper, fig. 3)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def mean_pass_at_k(correct: Sequence[Sequence[bool]], k: int) -> float:
    """pass@k averaged over prompts; `correct[p]`: the n verdicts of prompt p."""
    return mean(pass_at_k(len(row), sum(row), k) for row in correct)


def bootstrap_stderr(values: Sequence[float], *, seed: int, resamples: int = 1000) -> float:
    """Standard error of the mean of `values` (one per prompt): the standard deviation of the means of
    `resamples` resamples with replacement drawn by numpy's PCG64 seeded with `seed` (0 for one value)."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) < 2:
        return 0.0
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(values), size=(resamples, len(values)))
    return float(values[draws].mean(axis=1).std(ddof=1))


def majority_answer(answers: Sequence[str | None]) -> str | None:
    """The most common answer that is not None; a tie goes to the tied answer that occurs first in `answers`
    (sample order); None when no sample gave an answer."""
    counts: dict[str, int] = {}
    for answer in answers:
        if answer is not None:
            counts[answer] = counts.get(answer, 0) + 1  # dicts keep first-occurrence order
    if not counts:
        return None
    return max(counts, key=counts.__getitem__)  # max returns the first of equal maxima


def maj_at_k(answers: Sequence[Sequence[str | None]], correct: Sequence[Sequence[bool]], k: int) -> float:
    """maj@k averaged over prompts: a prompt counts as solved when the majority answer of its first k samples
    (`majority_answer`) is one the verifier judged correct there; no answer is wrong."""
    solved = []
    for prompt_answers, prompt_correct in zip(answers, correct, strict=True):
        chosen = majority_answer(prompt_answers[:k])
        solved.append(float(chosen is not None and any(
            a == chosen and ok for a, ok in zip(prompt_answers[:k], prompt_correct[:k]))))
    return mean(solved)
