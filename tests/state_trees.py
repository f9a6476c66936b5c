"""Comparison of state-dict trees (nested dicts, lists and tuples of tensors and plain values) for tests."""

import torch


def bit_identical(a, b) -> bool:
    """Whether two state-dict trees have the same structure, dtypes and bits."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(bit_identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(bit_identical(x, y) for x, y in zip(a, b))
    return a == b
