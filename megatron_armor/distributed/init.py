"""Process-group set-up: torchrun environment -> torch.distributed -> Megatron `parallel_state`."""

from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megatron_armor.config import ParallelConfig, check_expert_layout
from megatron_armor.config.builders import builds
from megatron_armor.distributed.cpu_compat import enable_cpu_compat
from megatron_armor.distributed.device import training_device
from megatron_armor.utils.net import free_port


@dataclass(frozen=True)
class DistributedContext:
    """Where this process sits in the job. Process groups themselves live in `parallel_state`."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        return f"rank {self.rank}/{self.world_size} (tp {self.tp_rank}, pp {self.pp_rank}, dp {self.dp_rank})"


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch; with CUDA also Megatron's model-parallel CUDA RNG tracker, which
    its on-GPU weight initialisation draws from (as Megatron-LM's `_set_random_seed`; needs `parallel_state`).
    Runs are dropout-free, so on CPU TP ranks can share one seed and still build identical state."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():  # after torch.manual_seed, which would reseed CUDA again
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


@builds(ParallelConfig)
def distributed_context(parallel: ParallelConfig, *, seed: int) -> DistributedContext:
    """`initialize_distributed` at the layout of the parallel section, seeded with `seed` (train.seed)."""
    return initialize_distributed(
        parallel.tensor_parallel_size, parallel.pipeline_parallel_size, parallel.data_parallel_size, seed=seed,
        expert_parallel_size=parallel.expert_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
    )


def initialize_distributed(
    tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, data_parallel_size: int | None = None, *,
    seed: int = 1234, timeout_minutes: int = 30, expert_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None, context_parallel_size: int = 1,
) -> DistributedContext:
    """Initialise torch.distributed from the torchrun environment (or as a 1-process group) and
    Megatron's tensor/pipeline/context/data-parallel groups. gloo on CPU, NCCL on GPU.

    `data_parallel_size` None takes whatever the world size leaves; an explicit value must match it.
    `expert_parallel_size`, `expert_tensor_parallel_size` (MoE models): Megatron's expert groups, which regroup each
    pipeline stage's TP x CP x DP ranks as expert TP x EP x expert DP: the routed experts are split over
    `expert_parallel_size` ranks and each expert's matrices over `expert_tensor_parallel_size` (None: the TP size,
    Megatron's default), so their product must divide TP x CP x DP (`config.check_expert_layout`).
    `context_parallel_size`: each sequence split over that many ranks (`distributed.context_parallel`); the
    data-parallel size is what the world leaves after TP x PP x CP.
    """
    if not dist.is_initialized():
        launched = "WORLD_SIZE" in os.environ  # torchrun (or a launcher setting its variables)
        use_cuda = torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            # A lone process rendezvouses on a port of its own without exporting it, so processes it
            # starts later (which inherit its environment) never try to reuse its port.
            init_method="env://" if launched else f"tcp://127.0.0.1:{free_port()}",
            rank=int(os.environ.get("RANK", "0")) if launched else 0,
            world_size=int(os.environ["WORLD_SIZE"]) if launched else 1,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    world_size = dist.get_world_size()
    _check_world_size(world_size, tensor_parallel_size, pipeline_parallel_size, context_parallel_size,
                      data_parallel_size)
    check_expert_layout(tensor_parallel_size, context_parallel_size,
                        world_size // (tensor_parallel_size * pipeline_parallel_size * context_parallel_size),
                        expert_parallel_size, expert_tensor_parallel_size)
    enable_cpu_compat()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel_size,
            pipeline_model_parallel_size=pipeline_parallel_size,
            context_parallel_size=context_parallel_size,
            expert_model_parallel_size=expert_parallel_size,
            expert_tensor_parallel_size=expert_tensor_parallel_size,
        )
    seed_everything(seed)
    return current_context()


def _check_world_size(world_size: int, tensor_parallel_size: int, pipeline_parallel_size: int,
                      context_parallel_size: int, data_parallel_size: int | None) -> None:
    """Raise ValueError unless TP x PP x CP (x DP, when given) fits `world_size` processes."""
    model_parallel = tensor_parallel_size * pipeline_parallel_size * context_parallel_size
    layout = (f"tensor_parallel_size ({tensor_parallel_size}) x pipeline_parallel_size ({pipeline_parallel_size}) x "
              f"context_parallel_size ({context_parallel_size})")
    if context_parallel_size < 1:
        raise ValueError(f"context_parallel_size must be >= 1, got {context_parallel_size}")
    if data_parallel_size is not None and world_size != model_parallel * data_parallel_size:
        raise ValueError(
            f"world size {world_size} does not match the layout {layout} x data_parallel_size ({data_parallel_size}) "
            f"= {model_parallel * data_parallel_size}; launch that many processes (torchrun --nproc-per-node, or "
            f"`armor train --nproc`)"
        )
    if world_size % model_parallel != 0:
        raise ValueError(f"world size {world_size} is not divisible by {layout}; launch a multiple of "
                         f"{model_parallel} processes")


def current_context() -> DistributedContext:
    """The `DistributedContext` of this process; requires `initialize_distributed` first."""
    return DistributedContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        device=training_device(),
    )


def destroy_model_parallel() -> None:
    """Tear down Megatron's groups and keep the default process group, so that this process can build another layout.

    Megatron's `parallel_state.destroy_model_parallel` destroys its gloo side groups but only forgets the others:
    each keeps its backend (for gloo, about three threads and its sockets) for the life of the process, so a process
    that builds dozens of layouts in turn (the parity checks) would end with thousands of threads polling their
    sockets. Here every group left but the default one is destroyed as well (torch keeps no public list of groups:
    `_world.pg_map` is c10d's own).
    """
    parallel_state.destroy_model_parallel()
    for group in [group for group in dist.distributed_c10d._world.pg_map if group is not dist.GroupMember.WORLD]:
        dist.destroy_process_group(group)


def destroy_distributed() -> None:
    """Tear down Megatron's groups and the default process group (safe to call twice)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
