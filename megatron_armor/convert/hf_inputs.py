"""Pre-flight check of an HF checkpoint before conversion: architecture, shards, tensor shapes.

Reads only config.json and the safetensors headers, so a bad input fails in seconds with one clear
message, before any process is launched or any output written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from megatron_armor.convert.hf_shards import SAFETENSORS_DTYPES
from megatron_armor.convert.mapping import model_mappings
from megatron_armor.convert.weights import CheckpointError, HFCheckpointReader
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
    reader = HFCheckpointReader(model_dir)
    headers = _read_headers(reader)
    expected = {name: hf_tensor_shape(name, shape) for m in model_mappings(shape) for name in m.hf_names}
    missing, unexpected = expected.keys() - reader.names(), reader.names() - expected.keys()
    if missing or unexpected:
        raise CheckpointError(
            f"{model_dir}: tensors do not match a {shape.arch} model with this config.json; "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    for name, want in expected.items():
        got = headers[name][0]
        if got != want:
            raise CheckpointError(
                f"{model_dir}/{reader.weight_map[name]}: tensor {name!r} has shape {list(got)}, config.json implies "
                f"{list(want)}; the weights and config.json come from different models"
            )
    dtypes = {headers[name][1] for name in expected}
    if len(dtypes) != 1:
        raise CheckpointError(f"{model_dir}: parameters mix dtypes {sorted(map(str, dtypes))}; convert them to one dtype first")
    num_bytes = sum(torch.Size(headers[n][0]).numel() * headers[n][1].itemsize for n in expected)
    return HFCheckpointSummary(shape=shape, dtype=dtypes.pop(), num_bytes=num_bytes)


def hf_tensor_shape(name: str, shape: ModelShape) -> tuple[int, ...]:
    """The shape config.json implies for HF tensor `name` (Llama/Qwen2/Qwen3 naming)."""
    h, d, f = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size
    q, kv = shape.num_attention_heads * d, shape.num_kv_heads * d
    suffixes = {
        "embed_tokens.weight": (shape.vocab_size, h), "lm_head.weight": (shape.vocab_size, h),
        "q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h), "o_proj.weight": (h, q),
        "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,), "q_norm.weight": (d,), "k_norm.weight": (d,),
        "gate_proj.weight": (f, h), "up_proj.weight": (f, h), "down_proj.weight": (h, f), "layernorm.weight": (h,),
        "norm.weight": (h,),
    }  # first matching suffix wins: q_norm/k_norm and *_layernorm are listed before the final norm
    return next(value for suffix, value in suffixes.items() if name.endswith(suffix))


def _read_headers(reader: HFCheckpointReader) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) from every shard's header; a missing or corrupt shard raises, naming it."""
    headers: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for file in sorted(set(reader.weight_map.values())):
        path = reader.model_dir / file
        if not path.is_file():
            raise CheckpointError(f"{path}: shard listed in model.safetensors.index.json is missing; re-download it")
        try:
            with safe_open(path, "pt") as shard:
                for name in shard.keys():
                    meta = shard.get_slice(name)
                    headers[name] = (tuple(meta.get_shape()), SAFETENSORS_DTYPES[meta.get_dtype()])
        except SafetensorError as error:
            raise CheckpointError(f"{path}: corrupt safetensors file ({error}); re-download it") from error
    lost = sorted(reader.weight_map.keys() - headers.keys())[:5]
    if lost:
        raise CheckpointError(f"{reader.model_dir}: tensors {lost} are listed in the index but absent from their shard")
    return headers




def side_files(model_dir: str | Path) -> list[Path]:
    """The non-weight files of a checkpoint directory (config, tokenizer, generation config, ...)."""
    return sorted(
        p for p in Path(model_dir).iterdir()
        if p.is_file() and not p.name.endswith(WEIGHT_FILE_SUFFIXES) and not p.name.startswith(".")
    )
