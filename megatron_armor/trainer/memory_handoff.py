"""GPU memory hand-off between colocated rollout servers and the trainer (`rollout.release_memory`).

Colocated placement puts each SGLang server (started with --enable-memory-saver) on a trainer rank's
GPU. While the trainer computes logprobs and updates the actor, the servers release their weights,
KV cache and CUDA graphs; they take them back before the updated weights are pushed. Rank 0 alone
talks to the servers (every rank's engine is a client of the same ones); the other ranks wait for
the release before they allocate.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import torch.distributed as dist

from megatron_armor.rollout.sglang_engine import SGLangEngine


class MemoryHandoff:
    """Releases the servers' GPU memory for the training phase of each step. `seconds`: what the last
    phase's release, barrier and resume took."""

    def __init__(self, engines: Sequence[SGLangEngine]) -> None:
        self.engines = list({id(engine): engine for engine in engines}.values())  # a shared engine once
        self.seconds = 0.0

    @contextlib.contextmanager
    def training_phase(self) -> Iterator[None]:
        """Collective: the servers hold no GPU memory inside the block, and all of it again after."""
        start = time.perf_counter()
        if dist.get_rank() == 0:
            for engine in self.engines:
                engine.release_memory()
        dist.barrier()
        self.seconds = time.perf_counter() - start
        try:
            yield
            # Every rank has freed what it parks (rollout.offload_trainer) before a server reclaims its memory;
            # on the normal path only, so that a failing rank never waits for the others.
            dist.barrier()
        finally:
            start = time.perf_counter()
            if dist.get_rank() == 0:
                for engine in self.engines:
                    engine.resume_memory()
            self.seconds += time.perf_counter() - start
