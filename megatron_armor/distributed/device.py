"""The device this process trains on: the one source of truth for placing Megatron models and their inputs."""

from __future__ import annotations

import torch
import torch.distributed as dist


def training_device() -> torch.device:
    """`cuda:<current device>` when CUDA is available (`initialize_distributed` selects LOCAL_RANK's GPU
    and the NCCL backend), else the CPU (gloo).

    Megatron models, every tensor fed to their forward, and the tensors of collectives live here.
    """
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where the tensors of a collective over `group` (default: the default group) must live: the training GPU under
    NCCL, else (gloo) the CPU."""
    return training_device() if dist.get_backend(group) == dist.Backend.NCCL else torch.device("cpu")
