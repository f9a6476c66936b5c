"""Megatron distributed checkpoints of a GPTModel: save, load (at any TP/PP layout), detect.

A converted checkpoint directory holds:
    dist_checkpoint/        Megatron-Core `dist_checkpointing` (torch_dist backend): one file per saving rank
    armor_checkpoint.json   `MegatronCheckpointInfo`: format version, architecture, saved layout, dtype
    config.json, tokenizer and generation files, copied verbatim from the source HF checkpoint
so `load_model_shape`/`load_tokenizer` work on it as on an HF directory, and export back to HF
needs nothing else. Tensors are stored under Megatron's global sharded keys (layers stacked, TP
shards as offsets of the full tensor), which is what lets a checkpoint saved at one TP x PP layout
load at another.
"""

from __future__ import annotations

import json
import queue
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.models.gpt import GPTModel
from torch.distributed.checkpoint.api import CheckpointException

from megatron_armor.convert.hf_inputs import side_files
from megatron_armor.convert.weights import CheckpointError, load_hf_weights
from megatron_armor.models.hf_config import ModelShape

INFO_FILE = "armor_checkpoint.json"
DIST_CHECKPOINT_DIR = "dist_checkpoint"
FORMAT_VERSION = 1
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class MegatronCheckpointInfo:
    """What `armor_checkpoint.json` records about a converted checkpoint."""

    format_version: int
    arch: str
    tensor_parallel_size: int  # layout it was saved at (any layout can load it)
    pipeline_parallel_size: int
    vocab_size: int
    padded_vocab_size: int
    dtype: str  # "float32" | "bfloat16" | "float16": the stored parameter dtype

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """torch dtype -> the `MegatronCheckpointInfo.dtype` string; refuses dtypes a model cannot hold."""
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise CheckpointError(f"parameter dtype {dtype} is not supported; supported: {sorted(_DTYPES)}")


def is_megatron_checkpoint(path: str | Path) -> bool:
    """True if `path` is a directory written by `save_megatron_checkpoint` (not an HF checkpoint)."""
    return (Path(path) / INFO_FILE).is_file() and (Path(path) / DIST_CHECKPOINT_DIR).is_dir()


def read_checkpoint_info(path: str | Path) -> MegatronCheckpointInfo:
    info_path = Path(path) / INFO_FILE
    if not is_megatron_checkpoint(path):
        raise CheckpointError(f"{path}: not a Megatron checkpoint (no {INFO_FILE} and {DIST_CHECKPOINT_DIR}/)")
    try:
        info = MegatronCheckpointInfo(**json.loads(info_path.read_text()))
    except (ValueError, TypeError) as error:
        raise CheckpointError(f"{info_path}: unreadable ({error}); re-run the conversion") from error
    if info.format_version != FORMAT_VERSION:
        raise CheckpointError(f"{info_path}: format_version {info.format_version}, this version reads {FORMAT_VERSION}")
    return info


def save_megatron_checkpoint(
    model: GPTModel, out_dir: str | Path, info: MegatronCheckpointInfo, *, strategy: TorchDistSaveShardedStrategy | None = None
) -> None:
    """Write this rank's shard of `model` under `out_dir/dist_checkpoint` with Megatron's torch_dist
    writer or `strategy` (e.g. `StreamingSaveStrategy`), then (rank 0) the info file.

    The info file marks the checkpoint complete (`is_megatron_checkpoint`): it is written only once
    every rank's save has returned, so a save that fails on any rank never leaves one. Collective
    over all ranks.
    """
    collect_write_results_in_process()
    ckpt = Path(out_dir) / DIST_CHECKPOINT_DIR
    if dist.get_rank() == 0:
        ckpt.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(ckpt), sharded_strategy=strategy)
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(out_dir) / INFO_FILE).write_text(json.dumps(asdict(info), indent=2) + "\n")
    dist.barrier()


def save_model_checkpoint(
    model: GPTModel, shape: ModelShape, out_dir: str | Path, *, side_files_from: str | Path,
    strategy: TorchDistSaveShardedStrategy | None = None,
) -> None:
    """`model` (this rank's stage/shard under the current parallel_state) as a complete Megatron
    checkpoint at `out_dir`, with the HF config/tokenizer files of `side_files_from` (an HF or
    Megatron checkpoint directory), copied first so that the info file comes last. Collective over
    all ranks."""
    info = MegatronCheckpointInfo(
        format_version=FORMAT_VERSION, arch=shape.arch,
        tensor_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        vocab_size=shape.vocab_size, padded_vocab_size=shape.padded_vocab_size,
        dtype=dtype_name(next(model.parameters()).dtype),
    )
    if dist.get_rank() == 0:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        copy_side_files(side_files_from, out_dir)
    save_megatron_checkpoint(model, out_dir, info, strategy=strategy)


def copy_side_files(source: str | Path, dest: str | Path) -> None:
    """Copy the config, tokenizer and generation files of checkpoint `source` (HF or Megatron) into
    `dest`, verbatim; a Megatron source's `armor_checkpoint.json` describes the source, so it stays."""
    for path in side_files(source):
        if path.name != INFO_FILE:
            shutil.copy2(path, Path(dest) / path.name)


def collect_write_results_in_process() -> None:
    """Megatron's torch_dist writer returns its write results through a queue served by a spawned
    `multiprocessing.Manager` process, made for its asynchronous save; that process imports torch to
    unpickle them (seconds and hundreds of MB per rank) and re-imports the `__main__` module. Our
    save is synchronous: the writer runs in this process, so a plain in-process queue serves."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "absent") is None:
        filesystem_async._results_queue = queue.Queue()


def load_megatron_weights(model: GPTModel, ckpt_dir: str | Path) -> None:
    """Fill this rank's stage/shard of `model` from a Megatron checkpoint saved at any TP/PP layout.

    Collective over all ranks (each reads only its slices). Raises `CheckpointError` when the
    checkpoint and the model disagree (missing/unexpected tensors, shapes).
    """
    info = read_checkpoint_info(ckpt_dir)
    try:
        state = dist_checkpointing.load(
            model.sharded_state_dict(), str(Path(ckpt_dir) / DIST_CHECKPOINT_DIR), strict=StrictHandling.RAISE_ALL
        )
    except CheckpointingException as error:
        raise CheckpointError(f"{ckpt_dir}: does not match the model ({info.arch} checkpoint): {error}") from error
    except CheckpointException as error:  # torch's (a BaseException): each failed rank's exception, wrapped
        causes = sorted({str(failure[0]) for failure in error.failures.values()})
        raise CheckpointError(f"{ckpt_dir}: does not match the model ({info.arch} checkpoint): {'; '.join(causes)}") from error
    model.load_state_dict(state, strict=True)


def load_model_weights(model: GPTModel, path: str | Path, shape: ModelShape) -> None:
    """Load `model`'s weights from `path`, a Megatron checkpoint (`armor convert`) or an HF directory."""
    if is_megatron_checkpoint(path):
        load_megatron_weights(model, path)
    else:
        load_hf_weights(model, path, shape)
