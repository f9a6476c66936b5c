"""DAPO soft overlong penalty."""

from __future__ import annotations


def overlong_penalty(response_length: int, max_response_length: int, buffer_length: int, factor: float = 1.0) -> float:
    """min(-(L - (Lmax - B)) / B * factor, 0): zero until the last `buffer_length` tokens, then
    linear down to -factor at Lmax. buffer_length 0 disables it (returns 0.0)."""
    if buffer_length == 0:
        return 0.0
    if not 0 < buffer_length <= max_response_length:
        raise ValueError(f"buffer_length must be in [0, max_response_length={max_response_length}], got {buffer_length}")
    if response_length < 0:
        raise ValueError(f"response_length must be >= 0, got {response_length}")
    return min(-(response_length - (max_response_length - buffer_length)) / buffer_length * factor, 0.0)
