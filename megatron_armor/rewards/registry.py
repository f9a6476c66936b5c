"""Reward functions named by dotted path: `package.module:function(response, row) -> (float, bool)`."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable

RewardFn = Callable[[str, dict], tuple[float, bool]]


class RewardError(ValueError):
    """A reward function that cannot be loaded or returned something unusable."""


def load_reward_fn(path: str) -> RewardFn:
    """Import `module:function`, e.g. `megatron_armor.rewards.arithmetic:verify`."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise RewardError(f"reward function {path!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise RewardError(f"reward function {path!r}: cannot import module {module_name!r} ({error})") from error
    fn = getattr(module, attr, None)
    if fn is None:
        raise RewardError(f"reward function {path!r}: module {module_name!r} has no attribute {attr!r}")
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
