"""Megatron distributed checkpoint -> HF safetensors checkpoint (sharded, with an index), by pp processes.

`convert_megatron_to_hf` validates the input and output, then runs `write_hf_stage` on pp ranks: in
this process for pp=1, else by launching `python -m megatron_armor.convert.cli megatron-to-hf ...`
again under torchrun. Each rank builds its pipeline stage at TP=1 on the meta device (no storage)
and streams it parameter by parameter (`MegatronStageReader`): read the full parameter from
the checkpoint (saved at any layout), split it into HF tensors, write them to its own safetensors
files (`model-s{stage:02d}-{k:05d}.safetensors`, at most `max_shard_bytes` each). Rank 0 then gives
the files HF's names (`model-0000i-of-0000n.safetensors`, stage order; one file:
`model.safetensors`), writes `model.safetensors.index.json` and copies config.json,
tokenizer and generation files verbatim; the staging directory is published when all is complete.

Memory per process: one full parameter and its HF split (the bytes go straight to the output
file, see `hf_shards`); not the model, the stage or an output shard. `read_megatron_checkpoint`
gives the same per-parameter reads to other tools (e.g. `armor diagnose`) without writing anything.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_armor.convert import workers
from megatron_armor.convert.carried import export_carried_tensors
from megatron_armor.convert.dist_checkpoint_reader import DistCheckpointReader
from megatron_armor.convert.hf_shards import SafetensorsShardWriter, TensorSpec, WrittenShard, name_shards
from megatron_armor.convert.mapping import ParamMapping, megatron_shards_to_hf
from megatron_armor.convert.megatron_checkpoint import DIST_CHECKPOINT_DIR, copy_side_files, read_checkpoint_info
from megatron_armor.convert.output_dir import check_output_dir, staged_output, staging_dir
from megatron_armor.convert.weights import CheckpointError, stage_mappings
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed
from megatron_armor.models.gpt import build_gpt_model
from megatron_armor.models.hf_config import check_parallel_layout, load_model_shape, transformer_config

DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3


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
            workers.run_conversion_workers(
                pp, ["megatron-to-hf", "--megatron-path", str(megatron_dir), "--out", str(out), "--pp", str(pp),
                     "--max-shard-size", repr(max_shard_bytes / 1024**3), "--worker"],
                failure=f"exporting {megatron_dir} failed in a worker process (output above); nothing written to {out}",
            )
    return Path(out)


def write_hf_stage(megatron_dir: str | Path, out: str | Path, *, pp: int, max_shard_bytes: int) -> None:
    """This rank's pipeline stage of the export, into `staging_dir(out)`; collective over pp ranks (TP=1)."""
    staging = staging_dir(out)
    initialize_distributed(1, pp, 1)
    try:
        stage = MegatronStageReader(megatron_dir, pp)
        check_tensor_keys(stage.sharded, stage.reader, megatron_dir)
        stage_rank = parallel_state.get_pipeline_model_parallel_rank()
        plan = [TensorSpec(name, tensor_shape, stage.dtype(mapping))
                for mapping in stage.mappings for name, tensor_shape in zip(mapping.hf_names, mapping.hf_shapes)]
        with SafetensorsShardWriter(staging, plan, max_shard_bytes, prefix=f"model-s{stage_rank:02d}") as writer:
            for mapping in stage.mappings:
                for name, tensor in zip(mapping.hf_names, stage.read(mapping)):
                    writer.add(name, tensor)
            shards = writer.close()
        written: list[tuple[int, list[WrittenShard]] | None] = [None] * pp
        dist.all_gather_object(written, (stage_rank, shards))
        if dist.get_rank() == 0:  # the stages' shards, then the carried tensors' (multi-token prediction)
            carried = export_carried_tensors(megatron_dir, staging, max_shard_bytes)
            name_shards(staging, [shard for _, stage_shards in sorted(written) for shard in stage_shards] + carried)
            copy_side_files(megatron_dir, staging)
        dist.barrier()
    finally:
        destroy_distributed()


def read_megatron_checkpoint(megatron_dir: str | Path) -> MegatronStageReader:
    """A reader of every HF tensor of the Megatron checkpoint at `megatron_dir`, in this process.

    Sets up (and tears down) a one-process torch.distributed group to build the model's sharded
    state dict: call it outside torchrun. The reads themselves need no process group.
    """
    initialize_distributed(1, 1, 1)
    try:
        return MegatronStageReader(megatron_dir, pp=1)
    finally:
        destroy_distributed()


class MegatronStageReader:
    """HF-named full tensors of this rank's pipeline stage (of `pp`) of the Megatron checkpoint at
    `megatron_dir`, saved at any layout; built under parallel_state (TP=1), reads need no collective.

    The stage is built at TP=1 on the meta device; a TP=1 parameter is one contiguous region of its
    stored global tensor (for a layer-stacked key, row `layer` of the `[num_layers, ...]` tensor).
    """

    def __init__(self, megatron_dir: str | Path, pp: int) -> None:
        self.megatron_dir = Path(megatron_dir)
        self.info, self.shape = read_checkpoint_info(megatron_dir), load_model_shape(megatron_dir)
        config = transformer_config(self.shape, pp_size=pp, params_dtype=self.info.torch_dtype)
        with torch.device("meta"):
            model = build_gpt_model(self.shape, config, trainable=False)  # shapes and sharding only
        self.sharded = model.sharded_state_dict()
        self.mappings = [m for m in stage_mappings(model, self.shape) if m.exported]
        self.reader = DistCheckpointReader(self.megatron_dir / DIST_CHECKPOINT_DIR)
        self._first_layer = get_transformer_layer_offset(config)
        self._stored = self.reader.tensor_shapes()

    def dtype(self, mapping: ParamMapping) -> torch.dtype:
        """The dtype `mapping`'s HF tensors are exported in: the checkpoint's (Megatron keeps norm weights in fp32),
        fp32 for a buffer (a router's expert bias, fp32 in Megatron and in transformers whatever the weights')."""
        return torch.float32 if mapping.buffer else self.info.torch_dtype

    def read(self, mapping: ParamMapping) -> list[torch.Tensor]:
        """The HF tensors of `mapping` (one of `mappings`, `hf_names` order) in their export dtype (`dtype`); reads
        that one parameter's region."""
        entry = self.sharded[mapping.megatron_name]
        key, param_shape = entry.key, tuple(entry.data.shape)
        lead, lead_sizes = self._leading_axes(mapping.megatron_name, key)
        want = lead_sizes + param_shape
        if key not in self._stored or tuple(self._stored[key]) != want:
            found = "absent" if key not in self._stored else f"stored with shape {list(self._stored[key])}"
            raise CheckpointError(f"{self.megatron_dir}: tensor {key!r} is {found}; its config.json implies {list(want)}")
        region = self.reader.read(key, lead + (0,) * len(param_shape), (1,) * len(lead) + param_shape)
        hf = megatron_shards_to_hf(mapping, [region.view(param_shape)], self.shape)
        return [t.to(self.dtype(mapping)) for t in hf]

    def _leading_axes(self, megatron_name: str, key: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(index, size) of the axes a stored tensor has before the parameter's own: the layer, where Megatron
        stacks the layers under one key (not in a model mixing dense and MoE layers, whose keys name the layer),
        then the expert (`mlp.experts.experts.*` holds all experts of a layer; built at EP=1, local = global)."""
        layer = re.match(r"decoder\.layers\.(\d+)\.", megatron_name)
        expert = re.search(r"\.local_experts\.(\d+)\.", megatron_name)
        stacked = layer is not None and not re.match(r"decoder\.layers\.\d+\.", key)
        lead = ((self._first_layer + int(layer.group(1)),) if stacked else ()) + ((int(expert.group(1)),) if expert else ())
        sizes = ((self.shape.num_layers,) if stacked else ()) + ((self.shape.num_experts,) if expert else ())
        return lead, sizes


def check_tensor_keys(sharded: dict, reader: DistCheckpointReader, megatron_dir: str | Path) -> None:
    """Refuse a checkpoint (at `megatron_dir`, read by `reader`) holding tensors that no pipeline stage
    reads (a partial read would silently drop them); `sharded`: this stage's sharded state dict.
    Collective over all ranks."""
    stage_keys = {entry.key for entry in sharded.values() if isinstance(entry, (ShardedTensor, ShardedTensorFactory))}
    every_stage: list[set[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every_stage, stage_keys)
    unread = sorted(reader.tensor_shapes().keys() - set().union(*every_stage))
    if unread:
        raise CheckpointError(f"{megatron_dir}: holds tensors that the model its config.json describes does not "
                              f"have: {unread[:5]}; the checkpoint and config.json disagree")
