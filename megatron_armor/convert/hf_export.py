"""Megatron distributed checkpoint -> HF safetensors checkpoint (sharded, with an index).

One process loads the checkpoint at TP=1, PP=1 (whatever layout it was saved at) and streams
full HF-named tensors from the one mapping table (`gather_hf_weights`) into safetensors files of at
most `max_shard_bytes` each. Peak memory: the model once plus one output shard being assembled.
config.json, tokenizer and generation files are copied back verbatim.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from megatron_armor.convert.hf_inputs import side_files
from megatron_armor.convert.megatron_checkpoint import INFO_FILE, load_megatron_weights, read_checkpoint_info
from megatron_armor.convert.output_dir import check_output_dir, discard, fresh_staging_dir, publish
from megatron_armor.convert.weights import gather_hf_weights
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed
from megatron_armor.models.gpt import build_gpt_model
from megatron_armor.models.hf_config import load_model_shape, transformer_config

DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsShardWriter:
    """Writes named tensors to `model-0000i-of-0000n.safetensors` files (or one `model.safetensors`).

    Tensors are buffered until the next one would push the shard past `max_shard_bytes`; a single
    larger tensor gets a shard of its own. `close()` names the files and writes the index.
    """

    def __init__(self, out_dir: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
        self.out_dir, self.max_shard_bytes = out_dir, max_shard_bytes
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shards: list[list[str]] = []  # tensor names of each written shard
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + size > self.max_shard_bytes:
            self._flush()
        self._buffer[name] = tensor.contiguous()
        self._buffer_bytes += size
        self.total_bytes += size

    def close(self) -> None:
        self._flush()
        count = len(self._shards)
        if count == 1:
            os.replace(self._temporary_name(0), self.out_dir / "model.safetensors")
            return
        weight_map = {}
        for i, names in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self._temporary_name(i), self.out_dir / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    def _flush(self) -> None:
        if not self._buffer:
            return
        save_file(self._buffer, self._temporary_name(len(self._shards)), metadata={"format": "pt"})
        self._shards.append(list(self._buffer))
        self._buffer, self._buffer_bytes = {}, 0

    def _temporary_name(self, index: int) -> Path:
        return self.out_dir / f"shard-{index:05d}.safetensors.tmp"


def is_hf_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def convert_megatron_to_hf(
    megatron_dir: str | Path, out: str | Path, *, overwrite: bool = False, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> Path:
    """Write the HF checkpoint of Megatron checkpoint `megatron_dir` to `out`; returns `out`.

    Initialises (and tears down) a one-process torch.distributed group; run it outside torchrun.
    """
    info = read_checkpoint_info(megatron_dir)
    shape = load_model_shape(megatron_dir)
    check_output_dir(out, overwrite=overwrite, is_checkpoint=is_hf_checkpoint, kind="Hugging Face")
    staging = fresh_staging_dir(out)
    try:
        initialize_distributed(1, 1, 1)
        model = build_gpt_model(shape, transformer_config(shape, params_dtype=info.torch_dtype), trainable=False)
        load_megatron_weights(model, megatron_dir)
        writer = SafetensorsShardWriter(staging, max_shard_bytes)
        for name, tensor in gather_hf_weights(model, shape):
            writer.add(name, tensor.to(info.torch_dtype))  # Megatron keeps norm weights in fp32
        writer.close()
        for path in side_files(megatron_dir):
            if path.name != INFO_FILE:
                shutil.copy2(path, staging / path.name)
        publish(staging, out)
    finally:
        destroy_distributed()
        discard(staging)
    return Path(out)
