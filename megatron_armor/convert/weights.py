"""Move weights between HF safetensors checkpoints and (tensor-parallel) Megatron GPTModels."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from safetensors import SafetensorError, safe_open

from megatron_armor.convert.hf_shards import SAFETENSORS_DTYPES
from megatron_armor.convert.mapping import (
    ParamMapping, for_expert_rank, hf_shard_index, hf_to_megatron_shard, megatron_shards_to_hf, model_mappings,
)
from megatron_armor.distributed.device import training_device
from megatron_armor.models.hf_config import ModelShape
from megatron_armor.models.lora import MergedTensors
from megatron_armor.models.tensors import checkpoint_tensors

# HF buffers that are not parameters of either model.
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
TIED_HEAD = "lm_head.weight"  # HF output weight; with tied embeddings the model uses embed_tokens instead


class CheckpointError(RuntimeError):
    """A checkpoint that does not match the model it is loaded into."""


def stage_mappings(model: GPTModel, shape: ModelShape, *, every_expert: bool = False) -> list[ParamMapping]:
    """The mappings of the pipeline stage `model` is, with global layer numbering: of this rank's parameters,
    or with `every_expert` also of the experts the other expert-parallel ranks hold."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    num_local = len(model.decoder.layers)
    fused_norms = any(name.endswith("linear_qkv.layer_norm_weight") for name, _ in model.named_parameters())
    mappings = model_mappings(
        shape,
        first_layer=get_transformer_layer_offset(model.config),
        num_layers=num_local,
        pre_process=model.pre_process,
        post_process=model.post_process,
        fused_norms=fused_norms,
        ep_size=parallel_state.get_expert_model_parallel_world_size(),
    )
    return mappings if every_expert else for_expert_rank(mappings, parallel_state.get_expert_model_parallel_rank())


class HFCheckpointReader:
    """Lazy reader of an HF checkpoint's safetensors files (single file or sharded with an index)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.model_dir / "model.safetensors").is_file():
            with safe_open(self.model_dir / "model.safetensors", "pt") as f:
                weight_map = {name: "model.safetensors" for name in f.keys()}
        else:
            raise CheckpointError(f"{self.model_dir}: no model.safetensors or model.safetensors.index.json found")
        self.weight_map: dict[str, str] = weight_map

    def names(self) -> set[str]:
        return {n for n in self.weight_map if not n.endswith(_IGNORED_HF_SUFFIXES)}

    def get(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor `name`, or only its part `index` (rows / columns, e.g. from `hf_shard_index`)."""
        if name not in self.weight_map:
            raise CheckpointError(f"{self.model_dir}: tensor {name!r} missing from the checkpoint")
        with safe_open(self.model_dir / self.weight_map[name], "pt") as f:
            return f.get_tensor(name) if index is None else f.get_slice(name)[index]

    def headers(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) from every shard's header; a missing or corrupt shard raises, naming it."""
        headers: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for file in sorted(set(self.weight_map.values())):
            path = self.model_dir / file
            if not path.is_file():
                raise CheckpointError(f"{path}: shard listed in model.safetensors.index.json is missing; re-download it")
            try:
                with safe_open(path, "pt") as shard:
                    for name in shard.keys():
                        meta = shard.get_slice(name)
                        headers[name] = (tuple(meta.get_shape()), SAFETENSORS_DTYPES[meta.get_dtype()])
            except SafetensorError as error:
                raise CheckpointError(f"{path}: corrupt safetensors file ({error}); re-download it") from error
        lost = sorted(self.weight_map.keys() - headers.keys())[:5]
        if lost:
            raise CheckpointError(f"{self.model_dir}: tensors {lost} are listed in the index but absent from their shard")
        return headers


def carried_names(reader: HFCheckpointReader, shape: ModelShape) -> list[str]:
    """The tensors of `reader`'s checkpoint in its multi-token-prediction layers (`shape.mtp_layers` layers after the
    decoder's: `model.layers.{num_layers + i}.*`), which the model does not build and conversion carries verbatim
    (`convert.carried`)."""
    prefixes = tuple(f"model.layers.{shape.num_layers + i}." for i in range(shape.mtp_layers))
    return sorted(name for name in reader.names() if prefixes and name.startswith(prefixes))


def check_hf_tensors(reader: HFCheckpointReader, shape: ModelShape) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of the HF tensors a `shape` model is built from (all stages together),
    from the safetensors headers only; raises `CheckpointError` unless the checkpoint of `reader` holds
    exactly those, each in the shape config.json implies (so reading TP slices of them is safe).

    Tensors of the multi-token-prediction layers (`carried_names`) are accepted and not checked here.
    With tied embeddings a stored `lm_head.weight` is also accepted and never read, as vLLM's loaders
    skip it: the model's output layer is the embedding itself, and some exporters still write the tied
    copy. It is not compared with the embedding, which would read two [vocab, hidden] tensors in a
    check that otherwise reads only headers.
    """
    headers = reader.headers()
    # name -> shape config.json implies, in model order: the first mismatch is named
    expected = {n: tensor_shape for m in model_mappings(shape) for n, tensor_shape in zip(m.hf_names, m.hf_shapes)}
    stored = reader.names() - ({TIED_HEAD} if shape.tie_word_embeddings else set()) - set(carried_names(reader, shape))
    missing, unexpected = set(expected) - stored, stored - set(expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{reader.model_dir}: tensors do not match a {shape.arch} model with this config.json; "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    for name, want in expected.items():
        got = headers[name][0]
        if got != want:
            raise CheckpointError(
                f"{reader.model_dir}/{reader.weight_map[name]}: tensor {name!r} has shape {list(got)}, config.json "
                f"implies {list(want)}; the weights and config.json come from different models"
            )
    return {name: headers[name] for name in expected}


def hf_parameter_source(model: GPTModel, model_dir: str | Path, shape: ModelShape) -> Callable[[str], torch.Tensor]:
    """A function: name of a parameter of `model` (this rank's stage and TP shard) -> its value, read
    from the HF checkpoint at `model_dir` when called: only this shard's rows / columns of the HF
    tensors that parameter is made of, so memory per rank shrinks with the TP size.

    Checks up front that the checkpoint has exactly the tensors the architecture needs
    (`check_hf_tensors`); each value is checked against the shape Megatron allocated for the
    parameter and comes in the parameter's dtype. Persistent buffers the mapping names (a router's expert bias) are
    read the same way (`models.tensors.checkpoint_tensors`).
    """
    reader = HFCheckpointReader(model_dir)
    check_hf_tensors(reader, shape)
    params = checkpoint_tensors(model)
    mappings = {m.megatron_name: m for m in stage_mappings(model, shape)}
    if set(mappings) != set(params):
        raise CheckpointError(f"mapping table and model disagree: {sorted(set(params) ^ set(mappings))}")

    def value(name: str) -> torch.Tensor:
        mapping = mappings[name]
        tp_rank, tp_size = _tensor_parallel_rank_and_size(mapping)
        index = hf_shard_index(mapping, shape, tp_rank, tp_size)
        shard = hf_to_megatron_shard(mapping, list(map(reader.get, mapping.hf_names, index)), shape, tp_size)
        if shard.shape != params[name].shape:
            raise CheckpointError(
                f"{model_dir}: {mapping.hf_names} gives {tuple(shard.shape)} for {name}, "
                f"model expects {tuple(params[name].shape)}"
            )
        return shard.to(params[name].dtype)  # e.g. bf16 HF norms into Megatron's fp32 norm weights

    return value


def load_hf_weights(model: GPTModel, model_dir: str | Path, shape: ModelShape) -> None:
    """Copy this rank's shard of every parameter (and persistent buffer) from an HF checkpoint into `model`."""
    source = hf_parameter_source(model, model_dir, shape)
    with torch.no_grad():
        for name, param in checkpoint_tensors(model).items():
            param.copy_(source(name))


def gather_hf_weights(
    model: GPTModel, shape: ModelShape, *, use_grads: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield this pipeline stage's parameters as full (TP-gathered) HF-named tensors, on every TP rank,
    on the parameters' device (consumers such as the weight transports handle GPU tensors).

    With `use_grads`, yields the reduced gradients (`main_grad` of Megatron DDP, else `.grad`) instead, of the
    parameters only (buffers, such as a router's fixed expert bias, have none).
    Without TP (and EP), all but a split fused QKV are views of the live parameter (or gradient) storage: clone
    what you keep. MoE experts come from every expert-parallel rank (gathered over the EP group; an expert's
    TP shards over the expert-TP group), so every rank yields every expert.
    A LoRA model's adapted weights come merged with their enabled adapters (`models.lora.MergedTensors`: what the
    model computes with; the base's inside `adapters_disabled`), so they are new tensors, not views.
    A collective over the TP (and EP) group: all its ranks must iterate it together.
    """
    params = checkpoint_tensors(model) if use_grads else MergedTensors(model)
    expert_copies: tuple[str, list[list[torch.Tensor]]] | None = None  # one expert parameter, every EP rank's
    with torch.no_grad():
        for mapping in _exported(stage_mappings(model, shape, every_expert=True), use_grads):
            local = _value(params[mapping.megatron_name], use_grads)
            if mapping.expert_rank is None:
                shards = _tensor_parallel_shards(mapping, local)
            else:
                if expert_copies is None or expert_copies[0] != mapping.megatron_name:
                    ep_group = parallel_state.get_expert_model_parallel_group()
                    copies = _all_gather(_tensor_parallel_shards(mapping, local), ep_group)
                    expert_copies = (mapping.megatron_name, copies)
                shards = expert_copies[1][mapping.expert_rank]
            yield from zip(mapping.hf_names, megatron_shards_to_hf(mapping, shards, shape))


def splitting_group(expert: bool) -> dist.ProcessGroup:
    """The group a tensor-parallel weight is split over: the TP group, or for an expert's the expert-TP group (the
    same ranks unless `expert_tensor_parallel_size` differs from TP)."""
    if expert:
        return parallel_state.get_expert_tensor_parallel_group()
    return parallel_state.get_tensor_model_parallel_group()


def _tensor_parallel_rank_and_size(mapping: ParamMapping) -> tuple[int, int]:
    """This rank's position in the group that splits `mapping`'s parameter (`splitting_group`)."""
    group = splitting_group(mapping.expert_rank is not None)
    return dist.get_rank(group), dist.get_world_size(group)


def _tensor_parallel_shards(mapping: ParamMapping, local: torch.Tensor) -> list[torch.Tensor]:
    """Every TP rank's shard of `mapping`'s parameter, `local` being this rank's (its own storage when not split)."""
    _, tp_size = _tensor_parallel_rank_and_size(mapping)
    if mapping.layout == "replicated" or tp_size == 1:
        return [local] * tp_size
    return _gather_one(local, splitting_group(mapping.expert_rank is not None), tp_size)


def _gather_one(local: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    """all_gather of one tensor over `group` (`size` ranks), in rank order."""
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local.contiguous(), group=group)
    return shards


def _all_gather(tensors: list[torch.Tensor], group) -> list[list[torch.Tensor]]:
    """Every rank of `group`'s `tensors` (same shapes on every rank), in rank order; without peers, `tensors`."""
    size = dist.get_world_size(group)
    if size == 1:
        return [tensors]
    gathered = [_gather_one(t, group, size) for t in tensors]
    return [[copies[rank] for copies in gathered] for rank in range(size)]


def parameters_exported_as_views(model: GPTModel, shape: ModelShape) -> list[torch.Tensor]:
    """The parameters (and persistent buffers) of this rank whose `gather_hf_weights` tensors are views of them: those
    its TP group (an expert's: its expert-TP group) does not split, but a fused QKV of several KV groups (split by
    copying), and the replicated ones (norms, a router's expert bias) under TP; experts only without EP (else they are
    gathered)."""
    params = checkpoint_tensors(model)
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    split_by_copy = "qkv" if shape.num_kv_heads > 1 else None
    return [
        params[m.megatron_name] for m in stage_mappings(model, shape)
        if m.exported and (m.expert_rank is None or ep_size == 1)
        and (m.layout == "replicated" or (_tensor_parallel_rank_and_size(m)[1] == 1 and m.layout != split_by_copy))
    ]


def gather_all_stages_hf_weights(
    model: GPTModel, shape: ModelShape, *, use_grads: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every stage's full HF-named tensors on every rank (TP-gathered, then passed along the pipeline).

    Stage by stage, the stage's ranks announce (name, shape, dtype) of its tensors (known without
    gathering any), then gather and broadcast them one by one over the pipeline group, so a rank
    holds one full tensor at a time, never a whole stage; other stages receive one tensor at a time, on
    `training_device()` (where the sending stage's parameters are). A collective over the TP and PP
    groups. Equals `gather_hf_weights` without pipeline parallelism.
    """
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if pp_size == 1:
        yield from gather_hf_weights(model, shape, use_grads=use_grads)
        return
    group = parallel_state.get_pipeline_model_parallel_group()
    stage_ranks = dist.get_process_group_ranks(group)
    my_stage = parallel_state.get_pipeline_model_parallel_rank()
    device = training_device()
    for stage, src in enumerate(stage_ranks):
        header = [_stage_header(model, shape, use_grads) if stage == my_stage else None]
        dist.broadcast_object_list(header, src=src, group=group)
        local = gather_hf_weights(model, shape, use_grads=use_grads) if stage == my_stage else None
        for name, tensor_shape, dtype in header[0]:
            if stage == my_stage:
                tensor = _next_announced(local, name, tensor_shape, dtype)
            else:
                tensor = torch.empty(tensor_shape, dtype=dtype, device=device)
            dist.broadcast(tensor, src=src, group=group)
            yield name, tensor


def _stage_header(model: GPTModel, shape: ModelShape, use_grads: bool) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(HF name, full shape, dtype) of every tensor `gather_hf_weights` yields for this stage, in order,
    from the mapping table and config.json's shapes alone (no collective)."""
    params = checkpoint_tensors(model)
    return [
        (name, tensor_shape, _value(params[m.megatron_name], use_grads).dtype)
        for m in _exported(stage_mappings(model, shape, every_expert=True), use_grads)
        for name, tensor_shape in zip(m.hf_names, m.hf_shapes)
    ]


def _exported(mappings: list[ParamMapping], use_grads: bool) -> list[ParamMapping]:
    """The mappings a stage exports: not the tied output layer's copy, and with `use_grads` no buffer (no gradient)."""
    return [m for m in mappings if m.exported and not (use_grads and m.buffer)]


def _next_announced(
    gathered: Iterator[tuple[str, torch.Tensor]], name: str, tensor_shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """The next gathered tensor (contiguous), checked against its header entry before it is broadcast."""
    got_name, tensor = next(gathered)
    if (got_name, tuple(tensor.shape), tensor.dtype) != (name, tensor_shape, dtype):
        raise RuntimeError(
            f"gathered {got_name} {tuple(tensor.shape)} {tensor.dtype}, announced {name} {tensor_shape} {dtype}"
        )
    return tensor.contiguous()


def _value(param: torch.nn.Parameter, use_grads: bool) -> torch.Tensor:
    if not use_grads:
        return param.detach()
    grad = getattr(param, "main_grad", None)
    grad = param.grad if grad is None else grad
    if grad is None:
        raise RuntimeError("gather_hf_weights(use_grads=True): a parameter has no gradient; run a backward pass first")
    return grad.detach()
