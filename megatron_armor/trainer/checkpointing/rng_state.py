"""Per-rank RNG states in a distributed checkpoint: Python's, numpy's, torch's CPU generator, CUDA's and
Megatron's model-parallel CUDA RNG tracker (the last two only where CUDA is available).

Each rank's states are one `ShardedObject` of a (PP, TP, DP) grid, so every rank writes its own. They
restore only at the layout they were saved at: after a layout change (resharding) a rank's old
position has no meaning, so every rank is reseeded deterministically from (train.seed, step, global rank)
and a warning says so. Training here is dropout-free and rollouts draw from explicit per-step seeds, so
the reseed changes no loss; it only changes draws that a run takes from the global generators.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_armor.distributed.init import seed_everything

log = logging.getLogger("megatron_armor")
RNG_KEY = "rng_state"


def layout() -> dict[str, int]:
    """This run's {"tp", "pp", "dp"} sizes, and "cp" under context parallelism (a layout without it is CP 1's, as
    every checkpoint saved before CP existed); parallel_state must be initialised."""
    sizes = {"tp": parallel_state.get_tensor_model_parallel_world_size(),
             "pp": parallel_state.get_pipeline_model_parallel_world_size(),
             "dp": parallel_state.get_data_parallel_world_size()}
    cp = parallel_state.get_context_parallel_world_size()
    return sizes if cp == 1 else {**sizes, "cp": cp}


def rng_sharded_object() -> ShardedObject:
    """This rank's RNG states as its cell of the (PP, TP, DP x CP) grid: saved by this rank alone."""
    grid = (layout()["pp"], layout()["tp"], parallel_state.get_data_parallel_world_size(with_context_parallel=True))
    position = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank(),
                parallel_state.get_data_parallel_rank(with_context_parallel=True))
    return ShardedObject(RNG_KEY, capture_rng_state(), grid, position, replica_id=0)


def capture_rng_state() -> dict[str, Any]:
    """{"python", "numpy", "torch"[, "cuda", "cuda_tracker"]}: this process's generator states."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
        state["cuda_tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back `capture_rng_state()`'s states (CUDA's only where CUDA is available and they were saved)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["cuda_tracker"])


def reseed_after_layout_change(seed: int, step: int, saved: dict[str, int]) -> None:
    """The saved layout differs from this run's: seed every generator from (seed, step, global rank)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        log.warning("checkpoint saved at %s, resumed at %s: RNG states are per rank and do not reshard; every rank "
                    "is reseeded from (train.seed, step, rank)", _describe(saved), _describe(layout()))
    seed_everything((seed * 1_000_003 + step * 1_009 + rank) % 2**31)


def _describe(sizes: dict[str, int]) -> str:
    """A `layout()` as "tp 2 x pp 1 x dp 2" (with " x cp N" under context parallelism)."""
    return " x ".join(f"{name} {size}" for name, size in sizes.items())
