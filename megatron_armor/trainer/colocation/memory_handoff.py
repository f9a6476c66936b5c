"""GPU memory hand-off between colocated rollout servers and the trainer (`rollout.memory.release_servers`).

Colocated placement puts each SGLang server (started with --enable-memory-saver) on a trainer rank's
GPU. While the trainer computes logprobs and updates the actor, the servers release their weights,
KV cache and CUDA graphs. They take them back in two stages, as verl does: the weights' memory first,
for the push of the updated weights (beside the trainer's copy of them), then, once the trainer has
parked that copy (`rollout.memory.offload_trainer`), the KV cache and CUDA graphs for generation. Rank 0
alone releases and resumes the servers (every rank's engine is a client of the same ones; the weights
reach each server from the rank it is dealt to, `rollout.push_assignment`); the other ranks wait at
barriers, so that no rank allocates before the release, or pushes or generates before the resume.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence

import torch.distributed as dist

from megatron_armor.config import MemoryHandoffConfig
from megatron_armor.config.builders import builds
from megatron_armor.rollout.base import RolloutEngine
from megatron_armor.rollout.sglang_engine import SGLangEngine
from megatron_armor.rollout.sglang_protocol import MEMORY_TAGS

log = logging.getLogger(__name__)

WEIGHT_TAGS = ("weights",)
SERVING_TAGS = ("kv_cache", "cuda_graph")  # what generation needs besides the weights


@builds(MemoryHandoffConfig)
def memory_handoff(
    settings: MemoryHandoffConfig, *, actor_engine: RolloutEngine, ref_engine: RolloutEngine,
) -> MemoryHandoff | None:
    """The servers' memory hand-off of a colocated run as rollout.memory says (`release_servers`), or None; the
    engines are the actor's and the reference's (one object when shared)."""
    if not settings.release_servers:
        return None
    if ref_engine is not actor_engine and not ref_engine.keeps_weights_across_release():
        raise ValueError(
            "rollout.memory.release_servers with separate reference servers (rollout.sglang.ref_urls) needs them "
            "started with --enable-weights-cpu-backup: their weights are pushed once, not after every release, and "
            "SGLang's memory saver loses them otherwise (armor ray-train --placement colocated starts them so)"
        )
    return MemoryHandoff([actor_engine, ref_engine])


class MemoryHandoff:
    """Releases the servers' GPU memory for the trainer's phases. `seconds`: what the hand-offs since the
    last `training_phase` took (release, barriers, resumes). Every tag is released and resumed once in
    turn (SGLang's memory saver refuses a second release or a resume of what is not released)."""

    def __init__(self, engines: Sequence[SGLangEngine]) -> None:
        self.engines = list({id(engine): engine for engine in engines}.values())  # a shared engine once
        self.seconds = 0.0
        self.released: set[str] = set()  # tags the servers hold released (rank 0 alone talks to them)

    @contextlib.contextmanager
    def training_phase(self, *, resume_serving: bool = True) -> Iterator[None]:
        """Collective: the servers hold no GPU memory inside the block. After it they take back their
        weights' memory and, unless `resume_serving` is False (the caller pushes weights first, then
        calls `resume_serving`), the rest. A failure inside gives everything back (`recover`)."""
        start = time.perf_counter()
        self._call(MEMORY_TAGS, release=True)
        dist.barrier()
        self.seconds = time.perf_counter() - start
        try:
            yield
            # Every rank has freed what it parks (rollout.memory.offload_trainer) before a server reclaims its memory;
            # on the normal path only, so that a failing rank never waits for the others.
            dist.barrier()
        except BaseException:
            self.recover()
            raise
        start = time.perf_counter()
        self._call(MEMORY_TAGS if resume_serving else WEIGHT_TAGS, release=False)
        dist.barrier()  # no rank generates, or pushes weights, before rank 0 has resumed the servers
        self.seconds += time.perf_counter() - start

    def resume_serving(self) -> None:
        """Collective: after a `training_phase(resume_serving=False)` and the weight push, the servers take
        back their KV cache and CUDA graphs."""
        start = time.perf_counter()
        dist.barrier()  # every rank has parked the weights it pushed
        self._call(SERVING_TAGS, release=False)
        dist.barrier()
        self.seconds += time.perf_counter() - start

    def recover(self) -> None:
        """After a failure inside a hand-off (no barrier: the other ranks may be anywhere): rank 0 gives the
        servers back what they hold released, best effort, so that long-lived servers serve again and a
        resumed run can release them again."""
        if dist.get_rank() != 0 or not self.released:
            return
        try:
            self._call(tuple(tag for tag in MEMORY_TAGS if tag in self.released), release=False)
        except Exception as error:  # the original failure is what the caller reports
            log.warning("could not give the rollout servers their memory back after a failure: %s", error)

    def _call(self, tags: Sequence[str], *, release: bool) -> None:
        if dist.get_rank() != 0:
            return
        for engine in self.engines:
            if release:
                engine.release_memory(list(tags))
            else:
                engine.resume_memory(list(tags))
        self.released = self.released | set(tags) if release else self.released - set(tags)
