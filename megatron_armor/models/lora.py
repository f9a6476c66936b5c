"""Low-rank adapters (LoRA) on Megatron's own tensor-parallel linear layers, the base weights frozen.

`apply_lora(model, settings)` gives each targeted `ColumnParallelLinear` / `RowParallelLinear` of a built and loaded
GPTModel stage a `LoRAAdapter` beside it (`<parent>.<layer>_adapter`, so that the parent's sharded state dict holds
it with its own TP sharding), whose forward hook on the layer adds `(alpha / r) B A x` to the layer's output, and
freezes every other parameter: Megatron's DDP and optimizers skip parameters without `requires_grad`, so
their gradient buffers and optimizer state hold the adapters only. The base layer and its parameter names are
untouched (the HF mapping, loaders and exports see the base model). `adapters_disabled(model)` turns every adapter
off: the model is then the base, the reference policy of a LoRA run.

Tensor parallelism splits the adapter factor that touches the layer's split dimension, as the layer is split:

    column-parallel W [out/tp, in]:  A [r, in] replicated,      B [out/tp, r] split on dim 0
        h = A x                                [s, b, r]   (under sequence parallelism x is [s/tp, b, in]:
        h = copy_to_tp(h) | gather_seq(h)                   h is gathered over the sequence, as the layer gathers x)
        y = B h                                [s, b, out/tp]
    row-parallel W [out, in/tp]:     A [r, in/tp] split on dim 1, B [out, r] replicated
        h = A x_local                          [s, b, r]   a partial sum over the TP ranks
        h = reduce_from_tp(h) | reduce_scatter_seq(h)      (as the layer reduces its output)
        y = B h                                [s(/tp), b, out]

The forward communication is on `[s, b, r]` tensors only. A replicated factor whose gradient each TP rank computes
from its own sequence chunk (column A, row B under sequence parallelism) is marked `sequence_parallel`, so
Megatron's `finalize_model_grads` sums it over the TP group as it does the norms' weights.
Routed experts (`experts=True`) need expert-TP size 1: their layers leave communication to the token dispatcher
(`explicit_expert_comm`), which this adapter does not join; their adapters are expert-parallel parameters
(`allreduce` False), reduced over the expert-data-parallel group like the experts' weights.

A is drawn kaiming-uniform (a = sqrt(5), PEFT's and the LoRA paper code's init) from a generator seeded by the run's
seed and the layer's global name (global layer and expert numbers), and split after drawing: the same adapters at
every TP / PP / EP layout. B starts at zero, so an adapted model's outputs equal the base's bit for bit.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region, reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

from megatron_armor.config.lora import LoRAConfig
from megatron_armor.models.tensors import checkpoint_tensors
from megatron_armor.utils.seeding import stable_seed

ADAPTER_SUFFIX = "_adapter"  # a layer's adapter sits beside it: `<parent>.linear_qkv_adapter.lora_a`, `.lora_b`


class LoRAError(ValueError):
    """Adapters that cannot be built on this model as `model.lora` asks."""


class LoRAAdapter(torch.nn.Module):
    """The adapter of one tensor-parallel linear layer (`host`): `lora_a` `[r, in or in/tp]` and `lora_b`
    `[out/tp or out, r]` in the host's dtype and device (see the module docstring for which is split), and the
    forward hook that adds `scale * B A dropout(x)` to the host's output while `enabled`. `glu`: the host is a gated
    MLP's fused fc1, whose rows (and B's) are this rank's gate rows then its up rows."""

    def __init__(self, host: ColumnParallelLinear | RowParallelLinear, settings: LoRAConfig, seed: int,
                 *, glu: bool = False) -> None:
        super().__init__()
        self.column, self.glu = isinstance(host, ColumnParallelLinear), glu
        if not self.column and not host.input_is_parallel:
            raise LoRAError("LoRA on a RowParallelLinear needs input_is_parallel (Megatron's layers all have it)")
        if self.column and host.gather_output:
            raise LoRAError("LoRA on a ColumnParallelLinear needs gather_output False (Megatron's layers all have it)")
        self.tp_group = host.tp_group
        tp_size, tp_rank = self.tp_group.size(), self.tp_group.rank()
        if host.is_expert and tp_size > 1:
            raise LoRAError(f"model.lora.experts needs parallel.expert_tensor_parallel_size 1, the experts are split "
                            f"over {tp_size} ranks")
        weight = host.weight
        a = torch.empty(settings.rank, host.input_size, dtype=torch.float32)  # drawn whole: the same at every TP
        torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=torch.Generator().manual_seed(seed))
        if self.column:
            b_shape = (host.output_size_per_partition, settings.rank)
        else:
            a = a.chunk(tp_size, dim=1)[tp_rank]
            b_shape = (host.output_size, settings.rank)
        self.lora_a = torch.nn.Parameter(a.to(device=weight.device, dtype=weight.dtype).contiguous())
        self.lora_b = torch.nn.Parameter(torch.zeros(b_shape, device=weight.device, dtype=weight.dtype))
        split = self.lora_b if self.column else self.lora_a
        for param in (self.lora_a, self.lora_b):
            set_tensor_model_parallel_attributes(param, is_parallel=param is split and tp_size > 1,
                                                 dim=0 if self.column else 1, stride=1)
            param.allreduce = getattr(weight, "allreduce", True)  # False: an expert-parallel parameter
        self.__dict__["host_weight"] = weight  # what `merged_weight` adds to; the host's, so not registered here
        self.sequence_parallel = host.sequence_parallel and not host.is_expert
        if self.sequence_parallel:  # each TP rank's gradient comes from its own sequence chunk: summed over TP
            (self.lora_a if self.column else self.lora_b).sequence_parallel = True
        self.communicates = tp_size > 1 and not host.explicit_expert_comm
        self.scale = settings.scale
        self.dropout = settings.dropout
        self.enabled = True
        host.register_forward_hook(self._add_to_output)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """`scale * B A dropout(x)` for the host's input `x` `[s(/tp), b, in or in/tp]`: `[s(/tp), b, out(/tp)]`,
        shaped as the host's output."""
        x = torch.nn.functional.dropout(x, self.dropout, self.training) if self.dropout else x
        h = torch.nn.functional.linear(x, self.lora_a)  # [s, b, r]; a partial sum over TP for a row-parallel layer
        if self.communicates:
            if self.column:
                h = (gather_from_sequence_parallel_region(h, group=self.tp_group) if self.sequence_parallel
                     else copy_to_tensor_model_parallel_region(h, group=self.tp_group))
            else:
                h = (reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group) if self.sequence_parallel
                     else reduce_from_tensor_model_parallel_region(h, group=self.tp_group))
        return torch.nn.functional.linear(h, self.lora_b) * self.scale

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """The host's weight shard with the adapter merged in, `W + scale B A` (a new tensor in W's dtype, summed in
        float32): column `[out/tp, in]` = `[out/tp, r] @ [r, in]`, row `[out, in/tp]` = `[out, r] @ [r, in/tp]`, so
        no communication is needed."""
        product = self.lora_b.float() @ self.lora_a.float()
        return (self.host_weight.float() + self.scale * product).to(self.host_weight.dtype)

    def full_factors(self, *, use_grads: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(A `[r, in]`, B `[out, r]`) whole, TP-gathered on every rank of the host's TP group (collective over it),
        B's rows in the TP=1 order (a gated fc1's: all gate rows, then all up rows); with `use_grads` their reduced
        gradients (DDP's `main_grad`) instead."""
        a, b = (_value(p, use_grads) for p in (self.lora_a, self.lora_b))
        size = self.tp_group.size()
        if size == 1:
            return a, b
        if not self.column:
            return torch.cat(_gather(a, self.tp_group), dim=1), b
        shards = _gather(b, self.tp_group)
        if self.glu:  # each shard is [its gate rows; its up rows]
            halves = [shard.chunk(2, dim=0) for shard in shards]
            return a, torch.cat([gate for gate, _ in halves] + [up for _, up in halves], dim=0)
        return a, torch.cat(shards, dim=0)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Megatron's sharded state of `lora_a` / `lora_b`: the split factor sharded over the host's TP group along
        the host's split axis (a gated fc1's B as Megatron shards the fc1 weight: gate and up halves apart), the
        other replicated; layer and expert offsets come in `sharded_offsets` and `prefix`, as for the host."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        axis = {"lora_b": 0} if self.column else {"lora_a": 1}
        state = make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, axis, sharded_offsets, tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"])
        if self.glu:
            key = f"{prefix}lora_b"
            state[key] = apply_swiglu_sharded_factory(
                state[key], sharded_offsets, metadata.get("singleton_local_shards", False), tp_group=self.tp_group,
                dp_group=metadata["dp_cp_group"])
        return state

    def _add_to_output(self, host: torch.nn.Module, args: tuple, output: tuple) -> tuple | None:
        """Forward hook of the host: its `(output, bias)` with the adapter's delta added to `output`."""
        if not self.enabled:
            return None
        out, bias = output
        return out + self.delta(args[0]), bias


def apply_lora(model: GPTModel, settings: LoRAConfig, *, seed: int = 0) -> list[LoRAAdapter]:
    """Give each layer of this stage that `settings` targets a `LoRAAdapter` and freeze every other parameter of
    `model` (a built, loaded GPTModel stage; before DDP wraps it). Returns the adapters in module order.

    Raises `LoRAError` when a target name matches no layer of the stage, when a target is not one of Megatron's own
    tensor-parallel linear layers (Transformer Engine's are not supported yet), when the rank exceeds a layer's
    smaller dimension, or when `experts` is asked of a model without routed experts."""
    if not settings.enabled:
        raise LoRAError("model.lora.rank is 0: there are no adapters to build")
    names = dict(_targets(model, settings))  # before any adapter is added beside them
    has_experts = any(".experts." in name for name, _ in model.named_modules())
    if settings.experts and not has_experts:
        raise LoRAError("model.lora.experts is set, but this model has no routed experts")
    found = {name.rsplit(".", 1)[-1] for name in names}
    missing = [target for target in settings.target_modules if target not in found]
    if missing:
        raise LoRAError(f"model.lora.target_modules {missing} match no layer of this model")
    model.requires_grad_(False)
    adapters = []
    for name, host in names.items():
        if not isinstance(host, (ColumnParallelLinear, RowParallelLinear)):
            raise LoRAError(f"{name} is a {type(host).__name__}; LoRA adapts Megatron's ColumnParallelLinear / "
                            f"RowParallelLinear (the local layer spec), not Transformer Engine's layers yet")
        if settings.rank > min(host.input_size, host.output_size):
            raise LoRAError(f"model.lora.rank {settings.rank} exceeds {name}'s smaller dimension "
                            f"(in {host.input_size}, out {host.output_size})")
        parent_name, _, attribute = name.rpartition(".")
        glu = attribute == "linear_fc1" and model.config.gated_linear_unit
        adapter = LoRAAdapter(host, settings, stable_seed("lora", seed, global_layer_name(model, name)), glu=glu)
        model.get_submodule(parent_name).add_module(attribute + ADAPTER_SUFFIX, adapter)
        adapters.append(adapter)
    if model.pre_process and model.config.recompute_granularity == "full":
        model.embedding.register_forward_hook(_require_grad)
    return adapters


def _require_grad(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """Forward hook of a frozen embedding: its output requires grad. A fully recomputed layer (Megatron's
    `tensor_parallel.checkpoint`, an autograd Function) whose inputs need no grad gives its adapters none."""
    return output.requires_grad_(True) if output.is_floating_point() and not output.requires_grad else output


def _targets(model: GPTModel, settings: LoRAConfig) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name, module) of every module of `model` that `settings` targets: its last name component is in
    `target_modules`, and it is not inside the routed experts unless `experts`."""
    wanted = set(settings.target_modules)
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in wanted and (settings.experts or ".experts." not in name):
            yield name, module


def global_layer_name(model: GPTModel, name: str) -> str:
    """`name` (a module of this stage) with its layer number made global (the pipeline stage's offset added) and,
    inside routed experts, its expert number too (this expert-parallel rank's first expert added): the same at every
    PP / EP layout."""
    offset = get_transformer_layer_offset(model.config)
    name = re.sub(r"(?<=^decoder\.layers\.)(\d+)", lambda m: str(int(m.group(1)) + offset), name)
    local_experts = model.config.num_moe_experts and (
        model.config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size())
    if not local_experts:
        return name
    first = parallel_state.get_expert_model_parallel_rank() * local_experts
    return re.sub(r"(?<=\.local_experts\.)(\d+)", lambda m: str(int(m.group(1)) + first), name)


def _value(param: torch.nn.Parameter, use_grads: bool) -> torch.Tensor:
    """`param` detached, or its reduced gradient (Megatron DDP's `main_grad`, else `.grad`)."""
    if not use_grads:
        return param.detach()
    grad = getattr(param, "main_grad", None)
    return (param.grad if grad is None else grad).detach()


def _gather(local: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Every rank of `group`'s `local` (same shape everywhere), in rank order."""
    shards = [torch.empty_like(local) for _ in range(group.size())]
    dist.all_gather(shards, local.contiguous(), group=group)
    return shards


def full_adapters(model: torch.nn.Module, *, use_grads: bool = False) -> dict[str, torch.Tensor]:
    """This pipeline stage's adapters whole: `<global layer name>_adapter.lora_a` -> A `[r, in]`, `.lora_b` -> B
    `[out, r]` (`LoRAAdapter.full_factors`; global layer and expert numbers, `global_layer_name`), the same at every
    layout. With `use_grads` their reduced gradients. Collective over each adapter's TP group."""
    module = getattr(model, "module", model)
    out = {}
    for name, adapter in module.named_modules():
        if isinstance(adapter, LoRAAdapter):
            a, b = adapter.full_factors(use_grads=use_grads)
            key = global_layer_name(module, name)
            out[f"{key}.lora_a"], out[f"{key}.lora_b"] = a, b
    return out


class MergedTensors(Mapping):
    """`checkpoint_tensors(model)` without the adapters' own parameters, each adapted layer's weight merged with its
    adapter (`LoRAAdapter.merged_weight`, made when looked up) while the adapter is enabled: the base weights the
    model computes with. What weight exports and pushes read; a model without adapters gives its own tensors."""

    def __init__(self, model: torch.nn.Module) -> None:
        tensors = checkpoint_tensors(model)
        self.merged: dict[str, LoRAAdapter] = {}
        for name, adapter in model.named_modules():
            if isinstance(adapter, LoRAAdapter):
                prefix = name.removesuffix(ADAPTER_SUFFIX)
                for key in (f"{name}.lora_a", f"{name}.lora_b"):
                    del tensors[key]
                if adapter.enabled:
                    self.merged[f"{prefix}.weight"] = adapter
        self.tensors = tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        adapter = self.merged.get(name)
        return self.tensors[name] if adapter is None else adapter.merged_weight()

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def adapter_entries(state: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of a model's state dict or Megatron sharded state dict (keys: module names,
    `...<layer>_adapter.lora_a` / `.lora_b`) that belong to its adapters: a LoRA run's trainable state, all that its
    checkpoints hold of the actor (the frozen base is `model.path`'s)."""
    return {key: value for key, value in state.items() if f"{ADAPTER_SUFFIX}." in key}


def lora_adapters(model: torch.nn.Module) -> list[LoRAAdapter]:
    """Every `LoRAAdapter` of `model` (a GPTModel or its DDP wrapper), in module order; empty without LoRA."""
    return [module for module in model.modules() if isinstance(module, LoRAAdapter)]


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Inside, every adapter of `model` is off and the model computes the base's outputs (the reference policy of a
    LoRA run); on exit each is as it was."""
    adapters = lora_adapters(model)
    states = [adapter.enabled for adapter in adapters]
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter, state in zip(adapters, states):
            adapter.enabled = state
