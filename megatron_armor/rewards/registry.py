"""Reward functions named by path, `package.module:function` or `path/to/file.py:function`, with the signature
`function(response, row) -> (float, bool)`."""

from __future__ import annotations

import math
from collections.abc import Callable

from megatron_armor.config.plugins import import_attribute

RewardFn = Callable[[str, dict], tuple[float, bool]]


class RewardError(ValueError):
    """A reward function that cannot be loaded or returned something unusable."""


def load_reward_fn(path: str) -> RewardFn:
    """Import `module:function` (e.g. `megatron_armor.rewards.arithmetic:verify`) or `path/to/file.py:function`
    (a file of the user's, no package or PYTHONPATH needed)."""
    try:
        fn = import_attribute(path, "reward function", "package.module:function")
    except ValueError as error:
        raise RewardError(str(error)) from error
    if not callable(fn):
        raise RewardError(f"reward function {path!r} is not callable")
    return fn


def score(fn: RewardFn, response: str, row: dict) -> tuple[float, bool]:
    """Call a reward function and validate its (finite float, bool) result."""
    result = fn(response, row)
    name = getattr(fn, "__qualname__", repr(fn))
    if not (isinstance(result, tuple) and len(result) == 2):
        raise RewardError(f"reward function {name} must return (reward, correct), got {result!r}")
    reward, correct = float(result[0]), result[1]
    if not math.isfinite(reward):
        raise RewardError(f"reward function {name} returned a non-finite reward {reward} for row {row}")
    return reward, bool(correct)
