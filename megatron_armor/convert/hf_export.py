"""Megatron distributed checkpoint -> HF safetensors checkpoint (sharded, with an index), by pp processes.

`convert_megatron_to_hf` validates the input and output, then runs `write_hf_stage` on pp ranks: in
this process for pp=1, else by launching `python -m megatron_armor.convert.cli megatron-to-hf ...`
again under torchrun. Each rank builds its pipeline stage at TP=1 on the meta device (no storage)
and streams it parameter by parameter (`stream_stage_hf_weights`): read the full parameter from
the checkpoint (saved at any layout), split it into HF tensors, hand them to its own safetensors
files (`model-s{stage:02d}-{k:05d}.safetensors`, at most `max_shard_bytes` each). Rank 0 then gives the files HF's names (`model-0000i-of-0000n.safetensors`, stage order;
one file: `model.safetensors`), writes `model.safetensors.index.json` and copies config.json,
tokenizer and generation files verbatim; the staging directory is published when all is complete.

Memory per process: one full parameter (and its HF split), plus the HF tensors buffered for the
output file being assembled (at most `max_shard_bytes`); not the model or the stage.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from safetensors.torch import save_file

from megatron_armor.convert.mapping import megatron_shards_to_hf
from megatron_armor.convert.dist_checkpoint_reader import DistCheckpointReader
from megatron_armor.convert.megatron_checkpoint import DIST_CHECKPOINT_DIR, copy_side_files, read_checkpoint_info
from megatron_armor.convert.output_dir import check_output_dir, staged_output, staging_dir
from megatron_armor.convert.weights import CheckpointError, stage_mappings
from megatron_armor.convert.workers import run_conversion_workers
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed
from megatron_armor.models.gpt import build_gpt_model
from megatron_armor.models.hf_config import ModelShape, check_parallel_layout, load_model_shape, transformer_config

DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class WrittenShard:
    """One safetensors file written by `SafetensorsShardWriter`, before it gets its final name."""

    file: str  # name in the output directory
    tensor_names: list[str]
    num_bytes: int  # bytes of its tensors


class SafetensorsShardWriter:
    """Writes named tensors to `{prefix}-{k:05d}.safetensors` files of at most `max_shard_bytes` each.

    Tensors are buffered until the next one would push the file past `max_shard_bytes`; a single
    larger tensor gets a file of its own. `close()` returns the files in order; `name_shards` gives
    them HF's names and writes the index.
    """

    def __init__(self, out_dir: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, *, prefix: str = "model-s00") -> None:
        self.out_dir, self.max_shard_bytes, self.prefix = out_dir, max_shard_bytes, prefix
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shards: list[WrittenShard] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + size > self.max_shard_bytes:
            self._flush()
        self._buffer[name] = tensor.contiguous()
        self._buffer_bytes += size

    def close(self) -> list[WrittenShard]:
        self._flush()
        return self._shards

    def _flush(self) -> None:
        if not self._buffer:
            return
        file = f"{self.prefix}-{len(self._shards):05d}.safetensors"
        save_file(self._buffer, self.out_dir / file, metadata={"format": "pt"})
        self._shards.append(WrittenShard(file, list(self._buffer), self._buffer_bytes))
        self._buffer, self._buffer_bytes = {}, 0


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


def is_hf_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def convert_megatron_to_hf(
    megatron_dir: str | Path, out: str | Path, *, pp: int = 1, overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write the HF checkpoint of Megatron checkpoint `megatron_dir` to `out` with `pp` processes; returns `out`.

    pp=1 runs here, initialising (and tearing down) a one-process torch.distributed group: call it
    outside torchrun. pp > 1 launches pp processes under torchrun, one pipeline stage each; it must
    divide the layer count. Every check runs before anything is written; on failure nothing is left
    at `out` (an existing checkpoint there is only replaced, with `overwrite`, once the new one is complete).
    """
    read_checkpoint_info(megatron_dir)
    check_parallel_layout(load_model_shape(megatron_dir), 1, pp)
    check_output_dir(out, overwrite=overwrite, is_checkpoint=is_hf_checkpoint, kind="Hugging Face")
    with staged_output(out):
        if pp == 1:
            write_hf_stage(megatron_dir, out, pp=1, max_shard_bytes=max_shard_bytes)
        else:
            run_conversion_workers(
                pp, ["megatron-to-hf", "--megatron-path", str(megatron_dir), "--out", str(out), "--pp", str(pp),
                     "--max-shard-size", repr(max_shard_bytes / 1024**3), "--worker"],
                failure=f"exporting {megatron_dir} failed in a worker process (output above); nothing written to {out}",
            )
    return Path(out)


def write_hf_stage(megatron_dir: str | Path, out: str | Path, *, pp: int, max_shard_bytes: int) -> None:
    """This rank's pipeline stage of the export, into `staging_dir(out)`; collective over pp ranks (TP=1)."""
    info, shape, staging = read_checkpoint_info(megatron_dir), load_model_shape(megatron_dir), staging_dir(out)
    initialize_distributed(1, pp, 1)
    try:
        config = transformer_config(shape, pp_size=pp, params_dtype=info.torch_dtype)
        with torch.device("meta"):
            model = build_gpt_model(shape, config, trainable=False)  # shapes and sharding only
        check_tensor_keys(model, megatron_dir)
        stage = parallel_state.get_pipeline_model_parallel_rank()
        writer = SafetensorsShardWriter(staging, max_shard_bytes, prefix=f"model-s{stage:02d}")
        for name, tensor in stream_stage_hf_weights(model, shape, megatron_dir):
            writer.add(name, tensor.to(info.torch_dtype))  # Megatron keeps norm weights in fp32
        written: list[tuple[int, list[WrittenShard]] | None] = [None] * pp
        dist.all_gather_object(written, (stage, writer.close()))
        if dist.get_rank() == 0:
            name_shards(staging, [shard for _, shards in sorted(written) for shard in shards])
            copy_side_files(megatron_dir, staging)
        dist.barrier()
    finally:
        destroy_distributed()


def stream_stage_hf_weights(model: GPTModel, shape: ModelShape, megatron_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors of the pipeline stage `model` (built at TP=1 on the meta device), read
    from the Megatron checkpoint one parameter at a time. Reads alone (no collective).

    A TP=1 parameter is one contiguous region of its stored global tensor (for a layer-stacked key,
    row `layer` of the `[num_layers, ...]` tensor), whatever layout the checkpoint was saved at.
    """
    reader = DistCheckpointReader(Path(megatron_dir) / DIST_CHECKPOINT_DIR)
    stored = reader.tensor_shapes()
    sharded = model.sharded_state_dict()
    first_layer = get_transformer_layer_offset(model.config)
    for mapping in stage_mappings(model, shape):
        if not mapping.exported:
            continue
        key, param_shape = sharded[mapping.megatron_name].key, tuple(sharded[mapping.megatron_name].data.shape)
        layer = re.match(r"decoder\.layers\.(\d+)\.", mapping.megatron_name)
        lead = () if layer is None else (first_layer + int(layer.group(1)),)
        want = (() if layer is None else (shape.num_layers,)) + param_shape
        if key not in stored or tuple(stored[key]) != want:
            found = "absent" if key not in stored else f"stored with shape {list(stored[key])}"
            raise CheckpointError(f"{megatron_dir}: tensor {key!r} is {found}; its config.json implies {list(want)}")
        region = reader.read(key, lead + (0,) * len(param_shape), (1,) * len(lead) + param_shape)
        yield from zip(mapping.hf_names, megatron_shards_to_hf(mapping, [region.view(param_shape)], shape))


def check_tensor_keys(model: GPTModel, megatron_dir: str | Path) -> None:
    """Refuse a checkpoint holding tensors that no pipeline stage of the model reads (a partial read
    would silently drop them). Collective over all ranks."""
    stage_keys = {entry.key for entry in model.sharded_state_dict().values()
                  if isinstance(entry, (ShardedTensor, ShardedTensorFactory))}
    every_stage: list[set[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every_stage, stage_keys)
    stored = DistCheckpointReader(Path(megatron_dir) / DIST_CHECKPOINT_DIR).tensor_shapes()
    unread = sorted(stored.keys() - set().union(*every_stage))
    if unread:
        raise CheckpointError(f"{megatron_dir}: holds tensors that the model its config.json describes does not "
                              f"have: {unread[:5]}; the checkpoint and config.json disagree")
