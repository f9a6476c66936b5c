"""The weight-update process group of `/update_weights_from_distributed`, both ends.

A standalone `ProcessGroup` (not the trainer's default group): the trainer is rank 0 and owns the
TCP store at master_address:master_port; server TP rank r of a server joins as `rank_offset + r`.
Tensors travel by broadcast from rank 0 (gloo on CPU, NCCL on GPU), in the order of the request's
names, or as one uint8 broadcast for load_format "flattened_bucket".
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_armor.rollout.sglang_protocol import DistributedUpdate, WeightGroupSpec
from megatron_armor.rollout.tensor_serialization import NamedTensors, flatten_bucket, flattened_layout, unflatten_bucket

WORLD_SIZE_KEY = "armor_world_size"  # the trainer's world size, published in the store for the servers to check


class WeightGroupError(ValueError):
    """A server cannot join the group it was asked to join."""


def backend_for_device(device: torch.device | str) -> str:
    """gloo for CPU tensors, nccl for CUDA ones."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _process_group(store: dist.Store, spec: WeightGroupSpec, rank: int, timeout: timedelta) -> dist.ProcessGroup:
    """Blocks until all `spec.world_size` ranks have joined (or `timeout`)."""
    store = dist.PrefixStore(spec.group_name, store)
    if spec.backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, spec.world_size, timeout)
    if spec.backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, spec.world_size, options)
    raise WeightGroupError(f"weight update group backend must be gloo or nccl, got {spec.backend!r}")


def create_as_trainer(spec: WeightGroupSpec, timeout: timedelta) -> dist.ProcessGroup:
    """Rank 0: host the store, publish the world size, and wait for every server rank to join."""
    store = dist.TCPStore(spec.master_address, spec.master_port, spec.world_size, is_master=True, timeout=timeout,
                          wait_for_workers=False)
    store.set(f"{spec.group_name}/{WORLD_SIZE_KEY}", str(spec.world_size))
    return _process_group(store, spec, 0, timeout)


def join_as_server(spec: WeightGroupSpec, tp_rank: int, timeout: timedelta) -> dist.ProcessGroup:
    """Server rank `rank_offset + tp_rank`: refuse a world size other than the trainer's, then join."""
    rank = spec.rank_offset + tp_rank
    try:
        store = dist.TCPStore(spec.master_address, spec.master_port, is_master=False, timeout=timeout)
    except (RuntimeError, dist.DistError) as error:
        raise WeightGroupError(
            f"cannot reach the trainer's store at {spec.master_address}:{spec.master_port} for group "
            f"{spec.group_name!r}: {error}"
        ) from error
    key = f"{spec.group_name}/{WORLD_SIZE_KEY}"
    if store.check([key]) and int(store.get(key)) != spec.world_size:
        raise WeightGroupError(
            f"group {spec.group_name!r}: the request says world_size {spec.world_size}, but the trainer at "
            f"{spec.master_address}:{spec.master_port} created it for {int(store.get(key))} ranks; world_size must be "
            f"1 + the TP ranks of all servers"
        )
    return _process_group(store, spec, rank, timeout)


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> dist.Work:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([tensor], options)


def broadcast_from_trainer(
    group: dist.ProcessGroup, named_tensors: Sequence[tuple[str, torch.Tensor]], load_format: str | None,
    device: torch.device | str = "cpu",
) -> None:
    """Rank 0's side of one /update_weights_from_distributed call (the servers must be receiving)."""
    if load_format == "flattened_bucket":
        _broadcast(group, flatten_bucket(named_tensors)["flattened_tensor"].to(device)).wait()
        return
    works = [_broadcast(group, tensor.detach().to(device).contiguous()) for _, tensor in named_tensors]
    for work in works:
        work.wait()


def receive_on_server(
    group: dist.ProcessGroup, update: DistributedUpdate, device: torch.device | str = "cpu"
) -> NamedTensors:
    """A server rank's side: fresh tensors on `device` (CUDA for an NCCL group) filled by rank 0's
    broadcasts, in the order of `update.names`."""
    buffers = update.empty_tensors(device)
    if update.load_format == "flattened_bucket":
        flat = torch.empty(sum(t.nbytes for _, t in buffers), dtype=torch.uint8, device=device)
        _broadcast(group, flat).wait()
        return unflatten_bucket(flat, flattened_layout(buffers))
    works = [_broadcast(group, tensor) for _, tensor in buffers]
    for work in works:
        work.wait()
    return buffers

