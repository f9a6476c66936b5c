"""Trainer ranks as Ray actors: each sets torchrun's environment and runs `run_training` on its bundle.

`TrainerRanks.run` returns when every rank has finished. If one rank fails, the others are killed at
once (as torchrun would) instead of waiting in a collective for the process-group timeout.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megatron_armor.config import ArmorConfig


class TrainerJobError(RuntimeError):
    """A trainer rank failed or exited with a non-zero code."""


class _TrainerRank:
    """One rank of the training job. Ray's CUDA_VISIBLE_DEVICES leaves it one GPU, so LOCAL_RANK is 0."""

    def __init__(self, rank: int, world_size: int) -> None:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          TOKENIZERS_PARALLELISM="false")
        self.rank = rank

    def master_address(self) -> tuple[str, int]:
        """(node IP, free port) for the process-group rendezvous, asked of rank 0."""
        from megatron_armor.utils.net import free_port

        host = ray.util.get_node_ip_address()
        return host, free_port(host)

    def run(self, cfg: ArmorConfig, master: tuple[str, int], resume: bool, overwrite: bool) -> int:
        import torch

        os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
        if cfg.train.logprob_head == "fused" and not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before Megatron imports triton (see `armor train`)
        from megatron_armor.trainer.run.train import run_training

        return run_training(cfg, resume=resume, overwrite=overwrite)


class TrainerRanks:
    """`world_size` trainer actors, rank r in bundle `bundle_indices[r]` of `placement_group`."""

    def __init__(
        self, world_size: int, placement_group: PlacementGroup, bundle_indices: list[int], *, cpus: float, gpus: float
    ) -> None:
        actor_cls = ray.remote(_TrainerRank)
        self._actors = [
            actor_cls.options(
                num_cpus=cpus, num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=b),
            ).remote(rank, world_size)
            for rank, b in enumerate(bundle_indices)
        ]

    def run(
        self, cfg: ArmorConfig, *, resume: bool = False, overwrite: bool = False, poll_s: float = 30.0,
        on_poll: Callable[[], None] = lambda: None,
    ) -> None:
        """Train on every rank; `on_poll` runs every `poll_s` seconds while they do (e.g. restart dead servers).

        Raises TrainerJobError naming the first rank that failed.
        """
        master = ray.get(self._actors[0].master_address.remote())
        refs = [a.run.remote(cfg, master, resume, overwrite) for a in self._actors]
        rank_of = {ref: r for r, ref in enumerate(refs)}
        pending = list(refs)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1, timeout=poll_s)
                for ref in done:
                    self._check(rank_of[ref], ref)
                if not done:
                    on_poll()
        finally:
            self.kill()

    def _check(self, rank: int, ref: ray.ObjectRef) -> None:
        try:
            code = ray.get(ref)
        except ray.exceptions.RayError as error:
            raise TrainerJobError(f"trainer rank {rank} failed: {error}") from error
        if code != 0:
            raise TrainerJobError(f"trainer rank {rank} exited with code {code}; its log says why (rank-prefixed)")

    def kill(self) -> None:
        for actor in self._actors:
            ray.kill(actor)
        self._actors = []
