"""Tensors an HF checkpoint holds that the Megatron model does not build (GLM-4.5's multi-token-prediction layers,
`convert.weights.carried_names`), carried through conversion bit for bit: HF -> Megatron copies them into the
Megatron checkpoint's `carried/` directory (safetensors files of their own, HF-named), Megatron -> HF writes them
back beside the model's tensors. Nothing trains them: a checkpoint exported after training carries the values it
was converted from, and a Megatron checkpoint written by training has none.
"""

from __future__ import annotations

from pathlib import Path

from megatron_armor.convert.hf_shards import SafetensorsShardWriter, TensorSpec, WrittenShard, name_shards
from megatron_armor.convert.weights import HFCheckpointReader, carried_names
from megatron_armor.models.shape import ModelShape

CARRIED_DIR = "carried"  # under a Megatron checkpoint directory
MAX_SHARD_BYTES = 2 * 1024**3


def save_carried_tensors(hf_dir: str | Path, shape: ModelShape, out_dir: str | Path) -> None:
    """Copy the carried tensors of HF checkpoint `hf_dir` (if any) into `out_dir/carried/`, one tensor in memory at a
    time."""
    reader = HFCheckpointReader(hf_dir)
    names = carried_names(reader, shape)
    if names:
        carried = Path(out_dir) / CARRIED_DIR
        carried.mkdir(parents=True)
        name_shards(carried, _copy(reader, names, carried, MAX_SHARD_BYTES, prefix="carried"))


def export_carried_tensors(megatron_dir: str | Path, out_dir: Path, max_shard_bytes: int) -> list[WrittenShard]:
    """Write the carried tensors of Megatron checkpoint `megatron_dir` (none without `carried/`) into `out_dir` as
    safetensors files, for `name_shards` to name with the model's."""
    carried = Path(megatron_dir) / CARRIED_DIR
    if not carried.is_dir():
        return []
    reader = HFCheckpointReader(carried)
    return _copy(reader, sorted(reader.names()), out_dir, max_shard_bytes, prefix="model-carried")


def _copy(reader: HFCheckpointReader, names: list[str], out_dir: Path, max_shard_bytes: int,
          prefix: str) -> list[WrittenShard]:
    headers = reader.headers()
    plan = [TensorSpec(name, *headers[name]) for name in names]
    with SafetensorsShardWriter(out_dir, plan, max_shard_bytes, prefix=prefix) as writer:
        for name in names:
            writer.add(name, reader.get(name))
        return writer.close()
