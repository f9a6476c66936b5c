"""Megatron sharded state dicts of the trainer's checkpointed modules, and their restore after a load.

`sharded_modules` maps `RLTrainer.checkpointed_modules()` to what Megatron's distributed checkpointing
saves and loads (trainer/checkpointing/checkpoint.py):
    "actor"      the actor's `sharded_state_dict()`: tensors under their global keys, TP/PP shards as
                 offsets of the full tensor, so they load at any TP x PP layout
    "optimizer"  {"megatron": Megatron's optimizer `sharded_state_dict(actor's)`, "adam_step": ShardedObject}:
                 the Adam moments (and a bf16 model's fp32 master weights) per parameter, sharded as the
                 parameter, as "optimizer.state.<exp_avg|exp_avg_sq>.<parameter key>"; the distributed optimizer
                 uses Megatron's `fully_reshardable` format (its DP shards gathered to DP rank 0 of each group
                 for the save, sliced again on load), the same tensors, so a checkpoint reshards over TP, PP
                 and DP and moves between the plain and the distributed optimizer (fp32 models: their master
                 weights are the weights, saved once as the actor's). The Adam step count (one for every
                 parameter) travels beside it
    "ref"        the reference's `sharded_state_dict(prefix="ref.")` (when the trainer checkpoints it)
    other        e.g. "subspace": the module's `state_dict()` as one object per (PP, TP) position,
                 replicated over DP: it resumes only at the TP x PP layout it was saved at
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedObject

from megatron_armor.distributed.cpu_compat import megatron_device_scope
from megatron_armor.trainer.update.optimizer import torch_optimizers

REF_PREFIX = "ref."
DISTRIBUTED_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}
MASTER_WEIGHT_KEYS = ("optimizer.state.param.", "optimizer.state.fp32_param.")  # distributed, plain optimizer


def sharded_modules(modules: dict[str, Any], *, is_loading: bool) -> dict[str, Any]:
    """{name: Megatron sharded state dict} of `modules` ({"actor": DDP model, "optimizer": its Megatron optimizer,
    ...}); the tensors are the live ones (a load fills them, or returns new ones to restore with `restore_module`)."""
    actor = _model_state(modules["actor"], "")
    sharded: dict[str, Any] = {}
    for name, module in modules.items():
        if name == "actor":
            sharded[name] = actor
        elif name == "optimizer":
            sharded[name] = _optimizer_state(module, actor, is_loading=is_loading)
        elif name == "ref":
            sharded[name] = _model_state(module, REF_PREFIX)
        else:
            sharded[name] = _layout_bound_object(name, module.state_dict())
    return sharded


def restore_order(names: list[str]) -> list[str]:
    """The order to restore modules in: the optimizer first, as a distributed optimizer's load also writes its
    fp32 master weights, views of the actor's weights; the actor's own restore then puts the saved weights."""
    return sorted(names, key=lambda name: name != "optimizer")


def restore_module(name: str, module: Any, state: Any) -> None:
    """Load `state` into `module`: a loaded `sharded_modules()` entry, or the module's own `state_dict()`."""
    if name == "optimizer" and isinstance(state, dict) and "adam_step" in state:
        target = getattr(module, "megatron_optimizer", module)  # ShardedStateOptimizer: Megatron's own load
        with megatron_device_scope():  # the distributed optimizer scatters its state on CUDA buffers
            _load_with_adam_step(target, state["megatron"], state["adam_step"])
    elif name == "ref":
        module.load_state_dict({key.removeprefix(REF_PREFIX): value for key, value in state.items()})
    else:
        module.load_state_dict(state)


def _model_state(model: torch.nn.Module, prefix: str) -> dict[str, Any]:
    """A (DDP-wrapped) GPTModel's sharded state dict with its tensor keys under `prefix`."""
    return getattr(model, "module", model).sharded_state_dict(prefix=prefix)


def _optimizer_state(optimizer: Any, actor: dict[str, Any], *, is_loading: bool) -> dict[str, Any]:
    """The "optimizer" entry of `sharded_modules` (see the module docstring). An fp32 model's distributed
    optimizer has no master weights of its own (its "fp32_param" tensors are views of the weights, saved as
    the actor): they are left out, so its checkpoint matches the plain optimizer's."""
    megatron = getattr(optimizer, "megatron_optimizer", optimizer)
    _init_adam_state(megatron)
    with megatron_device_scope():  # the distributed optimizer gathers its state over DP on CUDA buffers
        state = megatron.sharded_state_dict(actor, is_loading=is_loading, metadata=DISTRIBUTED_OPTIMIZER_FORMAT)
    config = megatron.config
    if not (config.bf16 or config.fp16):
        _drop_master_weights(state, keep_data=is_loading)
    step = ShardedObject("optimizer.adam_step", adam_step(megatron), (1,), (0,), replica_id=_global_rank())
    return {"megatron": state, "adam_step": step}


def _init_adam_state(optimizer: Any) -> None:
    """Give every parameter of an optimizer that has not stepped yet its Adam state (zero moments, step 0), as
    torch's first step would: Megatron's state dicts need it (a fresh torch optimizer's state is empty)."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(part, "init_state_fn", None) is not None and getattr(part, "optimizer", None) is not None:
            part.init_state_fn(part.optimizer, part.config)
    for inner in torch_optimizers(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                inner.state[param].setdefault("step", torch.tensor(0.0))


def _drop_master_weights(tree: Any, *, keep_data: bool) -> None:
    """Take every master-weight tensor in `tree` out of the checkpoint (in place): None in a save, its plain
    tensor in a load request (whatever it holds lands in views of the weights, which the actor's restore
    then overwrites: `restore_order`)."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, value in list(items):
        if isinstance(value, ShardedBase) and value.key.startswith(MASTER_WEIGHT_KEYS):
            tree[key] = value.data if keep_data else None
        else:
            _drop_master_weights(value, keep_data=keep_data)


def adam_step(optimizer: Any) -> int:
    """The number of Adam steps the optimizer (Megatron's, chained or not) took: its common per-parameter step."""
    for inner in torch_optimizers(optimizer):
        for state in [*inner.state.values(), *inner.param_groups]:
            if "step" in state:
                return int(state["step"])
    return 0


def _load_with_adam_step(optimizer: Any, state: dict[str, Any], step: int) -> None:
    """Megatron's `load_state_dict(state)`, then every parameter's Adam step set to `step` (the step in `state`
    is the loading optimizer's own: only sharded leaves come from the checkpoint). The plain optimizers' state
    dicts hold it as "common_step" beside the per-parameter state (Megatron drops the per-parameter one)."""
    for part in [state, *(value for key, value in state.items() if isinstance(key, int))]:
        torch_style = part.get("optimizer", part) if isinstance(part, dict) else None  # Float16Optimizer nests it
        if isinstance(torch_style, dict) and isinstance(torch_style.get("state"), dict):
            torch_style["state"]["common_step"] = torch.tensor(float(step))
    optimizer.load_state_dict(state)
    for inner in torch_optimizers(optimizer):
        for group in inner.param_groups:
            group.update({"step": step} if "step" in group else {})
            for param in group["params"]:
                inner.state[param]["step"] = torch.tensor(float(step))


def _layout_bound_object(name: str, state: Any) -> ShardedObject:
    """`state` as this (PP, TP) position's object, saved by DP rank 0 of the position (of its first CP rank: CP
    ranks hold the same state)."""
    grid = (parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_world_size())
    position = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank())
    return ShardedObject(f"{name}.state", state, grid, position, replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True))


def _global_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


RESHARDABLE = ("actor", "optimizer", "ref")


def check_layout_change(names: list[str], saved: dict[str, int], current: dict[str, int]) -> None:
    """Refuse a TP or PP change for a checkpoint with layout-bound modules (e.g. the subspace constraint)."""
    bound = [name for name in names if name not in RESHARDABLE]
    if bound and (saved["tp"], saved["pp"]) != (current["tp"], current["pp"]):
        raise ValueError(f"the checkpoint's {bound} state resumes only at the tensor and pipeline parallel sizes it "
                         f"was saved at (tp {saved['tp']} x pp {saved['pp']}), not tp {current['tp']} x pp {current['pp']}")
