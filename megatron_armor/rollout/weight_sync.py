"""A measured weight sync: stream HF-named tensors into an engine and report bytes and seconds."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from megatron_armor.rollout.base import RolloutEngine


@dataclass(frozen=True)
class SyncReport:
    """One sync: `bytes` and `tensors` sent, counted as the engine draws them; `seconds` from the call until
    the engine has them (it draws the lazy gather as it pushes, so the gather is included)."""

    bytes: int
    tensors: int
    seconds: float

    def metrics(self) -> dict[str, float]:
        return {
            "perf/weight_sync_seconds": self.seconds,
            "perf/weight_sync_bytes": float(self.bytes),
            "perf/weight_sync_gb_per_second": self.bytes / max(self.seconds, 1e-9) / 1e9,
        }


def sync_weights(
    engine: RolloutEngine, named_tensors: Iterable[tuple[str, torch.Tensor]], *, send: bool = True
) -> SyncReport:
    """`engine.update_weights(named_tensors)` (which leaves no cache of the old weights), counting what went through.

    With `send=False` the tensors are only drawn and counted (a rank that takes part in a collective
    gather while another rank talks to a shared engine).
    """
    counted = [0, 0]  # bytes, tensors

    def counting() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors:
            counted[0] += tensor.nbytes
            counted[1] += 1
            yield name, tensor

    start = time.perf_counter()
    if send:
        engine.update_weights(counting())
    else:
        for _ in counting():
            pass
    return SyncReport(bytes=counted[0], tensors=counted[1], seconds=time.perf_counter() - start)
