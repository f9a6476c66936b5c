"""Pre-flight check of an HF checkpoint before conversion: architecture, shards, tensor shapes.

Reads only config.json and the safetensors headers, so a bad input fails in seconds with one clear
message, before any process is launched or any output written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_armor.convert.mapping import model_mappings
from megatron_armor.convert.weights import CheckpointError, HFCheckpointReader, check_hf_tensors
from megatron_armor.models.hf_config import ModelShape, load_model_shape

# Files of an HF checkpoint directory that are weights (not copied alongside a Megatron checkpoint).
WEIGHT_FILE_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth")


@dataclass(frozen=True)
class HFCheckpointSummary:
    """A validated HF checkpoint: its architecture and the dtype its parameters are stored in."""

    shape: ModelShape
    dtype: torch.dtype
    num_bytes: int  # total size of the tensors


def inspect_hf_checkpoint(model_dir: str | Path) -> HFCheckpointSummary:
    """Validate `model_dir` for conversion; raises `ModelConfigError`/`CheckpointError` naming the problem."""
    shape = load_model_shape(model_dir)  # unknown architectures are refused here, listing the supported ones
    tensors = check_hf_tensors(HFCheckpointReader(model_dir), shape)
    buffers = {name for m in model_mappings(shape) if m.buffer for name in m.hf_names}  # fp32 whatever the weights
    dtypes = {dtype for name, (_, dtype) in tensors.items() if name not in buffers}
    if len(dtypes) != 1:
        raise CheckpointError(f"{model_dir}: parameters mix dtypes {sorted(map(str, dtypes))}; convert them to one dtype first")
    num_bytes = sum(math.prod(size) * dtype.itemsize for size, dtype in tensors.values())
    return HFCheckpointSummary(shape=shape, dtype=dtypes.pop(), num_bytes=num_bytes)


def side_files(model_dir: str | Path) -> list[Path]:
    """The non-weight files of a checkpoint directory (config, tokenizer, generation config, ...)."""
    return sorted(
        p for p in Path(model_dir).iterdir()
        if p.is_file() and not p.name.endswith(WEIGHT_FILE_SUFFIXES) and not p.name.startswith(".")
    )
