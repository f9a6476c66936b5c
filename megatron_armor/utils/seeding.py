"""Seeds derived from what identifies a random draw, so a draw repeats wherever and whenever it is made again."""

from __future__ import annotations

import hashlib


def stable_seed(*parts: object) -> int:
    """A stable 63-bit seed from the parts (base seed, step, batch, role, rank, ...): the same parts give the same
    seed in every process and run (unlike `hash`, which Python salts per process)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
