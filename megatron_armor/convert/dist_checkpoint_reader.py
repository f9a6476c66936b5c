"""Read any region of any tensor of a Megatron torch_dist checkpoint, in one process, with torch DCP.

`dist_checkpointing.load` reads a whole sharded state dict as one collective, and it can only
request part of a stored tensor (one layer of a layer-stacked tensor) when the other parts belong
to other ranks. Export streams one parameter at a time in a single process, so it reads the stored
chunks directly: torch's DCP computes which stored chunks overlap the requested region (its
resharding rule), and only those chunk files are read. Memory is the region plus one stored chunk.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


class DistCheckpointReader:
    """Tensor regions of the DCP checkpoint in `ckpt_dir` (Megatron's `dist_checkpoint/` directory)."""

    def __init__(self, ckpt_dir: str | Path) -> None:
        self._storage = FileSystemReader(str(ckpt_dir))
        metadata = self._storage.read_metadata()
        self._storage.set_up_storage_reader(metadata, is_coordinator=True)
        self._tensors = {
            key: md for key, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)
        }

    def tensor_shapes(self) -> dict[str, torch.Size]:
        """Global shape of every stored tensor, by Megatron sharded key."""
        return {key: md.size for key, md in self._tensors.items()}

    def read(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The region [offsets, offsets + sizes) of stored tensor `key`, in its stored dtype."""
        md = self._tensors[key]
        region = torch.empty(sizes, dtype=md.properties.dtype)
        items = create_read_items_for_chunk_list(
            key, md, [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))]
        )
        covered = sum(torch.Size(item.lengths).numel() for item in items)
        if covered != region.numel():
            raise RuntimeError(f"{key}: stored chunks cover {covered} of the {region.numel()} elements at {offsets}")
        self._storage.read_data(LoadPlan(items), _RegionTarget(region)).wait()
        return region


class _RegionTarget:
    """The part of `LoadPlanner` that `FileSystemReader.read_data` uses: where each read lands."""

    def __init__(self, region: torch.Tensor) -> None:
        self.region = region

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        view = self.region
        for dim, (start, length) in enumerate(zip(item.dest_offsets, item.lengths)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        del item, tensor  # the copy went straight into the region
