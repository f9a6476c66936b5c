"""HF safetensors output: tensors streamed into size-capped shard files, then HF's names and index.

A safetensors file is an 8-byte header length, a JSON header (name -> dtype, shape, byte range) and
the tensors' bytes. Every exported tensor's name, shape and dtype is known from config.json before
any weight is read, so each file's header is written first and every tensor's bytes go to disk as
soon as it arrives: memory is one tensor, whatever the shard size.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {
    "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
}
_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: HF name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class WrittenShard:
    """One safetensors file written by `SafetensorsShardWriter`, before it gets its final name."""

    file: str  # name in the output directory
    tensor_names: list[str]
    num_bytes: int  # bytes of its tensors


class SafetensorsShardWriter:
    """Writes the tensors of `plan`, in plan order, to `{prefix}-{k:05d}.safetensors` files of at most
    `max_shard_bytes` of tensor data each (a single larger tensor gets a file of its own).

    `add` must be called once per planned tensor, in order, with exactly the planned shape and dtype;
    `close()` checks that all came and returns the files; `name_shards` gives them HF's names.
    Use it as a context manager so that the open file is closed also when the export fails midway.
    """

    def __init__(self, out_dir: Path, plan: list[TensorSpec], max_shard_bytes: int, *, prefix: str = "model-s00") -> None:
        self.out_dir = out_dir
        self._files = _split_into_files(plan, max_shard_bytes)
        self._pending = iter([(index, spec) for index, specs in enumerate(self._files) for spec in specs])
        self._open: tuple[int, BinaryIO] | None = None
        self._shards = [
            WrittenShard(f"{prefix}-{k:05d}.safetensors", [s.name for s in specs], sum(s.num_bytes for s in specs))
            for k, specs in enumerate(self._files)
        ]

    def __enter__(self) -> SafetensorsShardWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self._close_file()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        index, spec = next(self._pending, (None, None))
        if spec is None or (name, tuple(tensor.shape), tensor.dtype) != (spec.name, spec.shape, spec.dtype):
            planned = "nothing" if spec is None else f"{spec.name} {list(spec.shape)} {spec.dtype}"
            raise ValueError(f"safetensors writer: got {name} {list(tensor.shape)} {tensor.dtype}, planned {planned}")
        if self._open is None or self._open[0] != index:
            self._close_file()
            stream = open(self.out_dir / self._shards[index].file, "wb")
            _write_header(stream, self._files[index])
            self._open = (index, stream)
        self._open[1].write(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().data)

    def close(self) -> list[WrittenShard]:
        self._close_file()
        missing = [spec.name for _, spec in self._pending]
        if missing:
            raise ValueError(f"safetensors writer: {len(missing)} planned tensors never came, e.g. {missing[:3]}")
        return self._shards

    def _close_file(self) -> None:
        if self._open is not None:
            self._open[1].close()
            self._open = None


def _split_into_files(plan: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    files: list[list[TensorSpec]] = []
    size = 0
    for spec in plan:
        if not files or (files[-1] and size + spec.num_bytes > max_shard_bytes):
            files.append([])
            size = 0
        files[-1].append(spec)
        size += spec.num_bytes
    return files


def _write_header(stream: BinaryIO, specs: list[TensorSpec]) -> None:
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": _DTYPE_NAMES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.num_bytes]}
        offset += spec.num_bytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    stream.write(struct.pack("<Q", len(encoded)))
    stream.write(encoded)


def name_shards(out_dir: Path, shards: list[WrittenShard]) -> None:
    """Rename `shards` (in order) to `model-0000i-of-0000n.safetensors` and write the index;
    a single file becomes `model.safetensors` (no index)."""
    if len(shards) == 1:
        os.replace(out_dir / shards[0].file, out_dir / "model.safetensors")
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(out_dir / shard.file, out_dir / final)
        weight_map.update(dict.fromkeys(shard.tensor_names, final))
    total = sum(shard.num_bytes for shard in shards)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
