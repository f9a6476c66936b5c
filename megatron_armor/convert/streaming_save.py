"""Save a Megatron distributed checkpoint whose tensors are produced one at a time while writing.

`dist_checkpointing.save` needs the whole sharded state dict up front, and Megatron's torch_dist
writer copies every tensor before the first byte is written (it is built for asynchronous saves).
For conversion that would hold the full model shard in memory. Here the model is built on the
`meta` device (shapes and sharding only, no storage), Megatron's planning and metadata are used
unchanged, and each tensor is materialised by a callback only when the writer reaches it, then
released: peak memory is the largest parameter group the callback builds, not the model.

The files are Megatron's torch_dist format (torch DCP plus Megatron's metadata.json and
common.pt), written by torch's `FileSystemWriter` with one file per tensor chunk (its
`single_file_per_rank` mode keeps every tensor of a file referenced until the file is closed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.mapping import ShardedStateDict, ShardedTensor
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint.metadata import MetadataIndex

from megatron_armor.models.tensors import checkpoint_tensors

# name of a meta-device parameter -> its real value (same shape and dtype)
Materialize = Callable[[str], torch.Tensor]


class StreamingSaveStrategy(TorchDistSaveShardedStrategy):
    """torch_dist save of a meta-device model's sharded state dict; `materialize(name)` gives the real
    value of parameter `name` of `model` when the writer needs it (the last one is kept for the
    chunks that share it, e.g. the gate and up halves of a SwiGLU fc1)."""

    def __init__(self, model: torch.nn.Module, materialize: Materialize) -> None:
        super().__init__("torch_dist", 1)
        tensors = checkpoint_tensors(model)  # parameters and persistent buffers (a router's expert bias)
        real = [name for name, tensor in tensors.items() if not tensor.is_meta]
        if real:
            raise ValueError(f"StreamingSaveStrategy needs a model built on the meta device; {real[:3]} have storage")
        self._names = {id(tensor): name for name, tensor in tensors.items()}
        self._materialize = materialize
        self._current: tuple[str, torch.Tensor] | None = None

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        by_key, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
        chunks = {
            (key, tuple(chunk.global_offset)): self._chunk_of_parameter(chunk.data)
            for key, group in by_key.items() for chunk in group if isinstance(chunk, ShardedTensor)
        }
        planner = _MaterializingPlanner(
            lambda index: self._real_chunk(chunks[(index.fqn, tuple(index.offset))]),
            dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False,
            flatten_sharded_tensors=False,
        )
        dcp.save(
            mcore_to_pyt_state_dict(by_key, False),
            storage_writer=dcp.FileSystemWriter(checkpoint_dir, single_file_per_rank=False, thread_count=1),
            planner=planner,
        )
        self._current = None

    def _chunk_of_parameter(self, placeholder: torch.Tensor) -> _ParameterChunk:
        """Where the meta tensor `placeholder` (a parameter or a view of one, e.g. a chunk) lies."""
        base = placeholder if placeholder._base is None else placeholder._base
        if id(base) not in self._names:
            raise RuntimeError(
                "streaming save: a checkpoint tensor is not a model parameter or a view of one; only parameters "
                "can be materialised"
            )
        return _ParameterChunk(self._names[id(base)], tuple(base.shape), base.dtype, tuple(placeholder.shape),
                               placeholder.stride(), placeholder.storage_offset())

    def _real_chunk(self, chunk: _ParameterChunk) -> torch.Tensor:
        if self._current is None or self._current[0] != chunk.name:
            self._current = None  # release the previous group before building the next
            value = self._materialize(chunk.name)
            if tuple(value.shape) != chunk.param_shape or value.dtype != chunk.dtype:
                raise RuntimeError(
                    f"streaming save: {chunk.name} materialised as {tuple(value.shape)} {value.dtype}, the model "
                    f"expects {chunk.param_shape} {chunk.dtype}"
                )
            self._current = (chunk.name, _own_storage(value.contiguous()))
        value = self._current[1]
        return value.as_strided(chunk.shape, chunk.stride, value.storage_offset() + chunk.storage_offset)


def _own_storage(value: torch.Tensor) -> torch.Tensor:
    """`value` (contiguous), copied when it is a view into a larger storage (e.g. a TP slice of a
    whole HF tensor), which keeping it would otherwise hold in memory."""
    return value.clone() if value.untyped_storage().nbytes() > value.numel() * value.element_size() else value


@dataclass(frozen=True)
class _ParameterChunk:
    """A saved tensor as a strided view of parameter `name` (shape `param_shape`, contiguous)."""

    name: str
    param_shape: tuple[int, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int


class _MaterializingPlanner(MCoreSavePlanner):
    """Megatron's save planner whose tensor lookups return real data (from `real_chunk(index)`) in place
    of the meta placeholders, in the placeholder's shape (which may carry prepended layer axes)."""

    def __init__(self, real_chunk: Callable[[MetadataIndex], torch.Tensor], **kwargs) -> None:
        super().__init__(**kwargs)
        self._real_chunk = real_chunk

    def lookup_object(self, index: MetadataIndex):
        value = super().lookup_object(index)
        if isinstance(value, torch.Tensor) and value.is_meta:
            return self._real_chunk(index).view(value.shape)
        return value
