"""Megatron sharded state dicts of the trainer's checkpointed modules, and their restore after a load.

`sharded_modules` maps `RLTrainer.checkpointed_modules()` to what Megatron's distributed checkpointing
saves and loads (trainer/checkpointing/checkpoint.py); a policy's entry is its `Policy.sharded_state_dict()`:
    "actor"      the actor's model's: tensors under their global keys, TP/PP shards as
                 offsets of the full tensor, so they load at any TP x PP layout. A LoRA run's holds its adapters
                 alone (`Policy.adapters_only`): the frozen base is model.path's, which the checkpoint names
                 (trainer/checkpointing/lora_base.py), and the optimizer's entry holds the adapters' state only
    "optimizer"  {"megatron": Megatron's optimizer `sharded_state_dict(actor's)`, "adam_step": ShardedObject}:
                 the Adam moments (and a bf16 model's fp32 master weights) per parameter, sharded as the
                 parameter, as "optimizer.state.<exp_avg|exp_avg_sq>.<parameter key>"; the distributed optimizer
                 uses Megatron's `fully_reshardable` format (its DP shards gathered to DP rank 0 of each group
                 for the save, sliced again on load), the same tensors, so a checkpoint reshards over TP, PP
                 and DP and moves between the plain and the distributed optimizer (bf16 models: the distributed
                 optimizer's master weights are saved under the plain one's key, "optimizer.state.fp32_param.<key>";
                 fp32 models: their master weights are the weights, saved once as the actor's). The Adam step
                 count (one for every parameter) travels beside it
    "ref"        the reference's sharded state dict, its keys behind "ref." (when the trainer checkpoints it)
    other        e.g. "subspace": the module's `state_dict()` as one object per (PP, TP) position,
                 replicated over DP: it resumes only at the TP x PP layout it was saved at
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedObject

from megatron_armor.algorithms import ACTOR, REFERENCE
from megatron_armor.distributed.cpu_compat import megatron_device_scope
from megatron_armor.trainer.step_inputs.policies import Policy
from megatron_armor.trainer.update.optimizer import torch_optimizers

OPTIMIZER = "optimizer"  # the actor's optimizer's entry
DISTRIBUTED_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}
DISTRIBUTED_MASTER_KEY, PLAIN_MASTER_KEY = "optimizer.state.param.", "optimizer.state.fp32_param."
MASTER_WEIGHT_KEYS = (DISTRIBUTED_MASTER_KEY, PLAIN_MASTER_KEY)


def sharded_modules(modules: dict[str, Any], *, is_loading: bool) -> dict[str, Any]:
    """{name: Megatron sharded state dict} of `modules` ({"actor": the actor `Policy`, "optimizer": its Megatron
    optimizer, ...}); the tensors are the live ones (a load fills them, or returns new ones to restore with
    `restore_module`)."""
    sharded = {name: module.sharded_state_dict() for name, module in modules.items() if isinstance(module, Policy)}
    for name, module in modules.items():
        if name == OPTIMIZER:
            sharded[name] = _optimizer_state(module, sharded[ACTOR], is_loading=is_loading)
        elif name not in sharded:
            sharded[name] = _layout_bound_object(name, module.state_dict())
    return {name: sharded[name] for name in modules}


def restore_order(names: list[str]) -> list[str]:
    """The order to restore modules in: the optimizer first, as a distributed optimizer's load also writes its
    fp32 master weights, views of the actor's weights; the actor's own restore then puts the saved weights."""
    return sorted(names, key=lambda name: name != OPTIMIZER)


def restore_module(name: str, module: Any, state: Any) -> None:
    """Load `state` into `module`: a loaded `sharded_modules()` entry, or the module's own `state_dict()` (a `Policy`
    takes its checkpoint prefix off the keys itself)."""
    if name == OPTIMIZER and isinstance(state, dict) and "adam_step" in state:
        target = getattr(module, "megatron_optimizer", module)  # ShardedStateOptimizer: Megatron's own load
        with megatron_device_scope():  # the distributed optimizer scatters its state on CUDA buffers
            _load_with_adam_step(target, state["megatron"], state["adam_step"])
    else:
        module.load_state_dict(state)


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
    else:
        _rename_master_weights(state)
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


def _rename_master_weights(tree: Any) -> None:
    """Put the distributed optimizer's fp32 master weights ("optimizer.state.param.<key>") under the plain optimizer's
    key ("optimizer.state.fp32_param.<key>"), in place, in a save or a load request: both shard them as the parameter
    (the distributed one in its `fully_reshardable` form), so under one key a bf16 model's checkpoint moves between
    the two optimizers."""
    for value in tree.values() if isinstance(tree, dict) else tree if isinstance(tree, list) else ():
        if isinstance(value, ShardedBase) and value.key.startswith(DISTRIBUTED_MASTER_KEY):
            value.key = PLAIN_MASTER_KEY + value.key.removeprefix(DISTRIBUTED_MASTER_KEY)
        else:
            _rename_master_weights(value)


def check_precision_change(saved_keys: set[str], request: dict[str, Any]) -> None:
    """Refuse to resume an "optimizer" across parameter dtypes: a bf16 model's optimizer keeps fp32 master weights
    (under `PLAIN_MASTER_KEY`, or `DISTRIBUTED_MASTER_KEY` in a distributed optimizer's checkpoint written before the
    two shared a key), an fp32 model's has none, so neither state is the other's. `saved_keys`: the checkpoint's
    tensor keys; `request`: the loading trainer's sharded modules."""
    if "optimizer" not in request:
        return
    wanted = _has_key(request["optimizer"], PLAIN_MASTER_KEY)
    saved = any(key.startswith(MASTER_WEIGHT_KEYS) for key in saved_keys)
    if wanted != saved:
        dtypes = ("float32", "bfloat16") if wanted else ("bfloat16", "float32")
        raise ValueError(
            f"the checkpoint's optimizer was saved with model.params_dtype {dtypes[0]} and this run trains in "
            f"{dtypes[1]}: Adam's state of one is not the other's (a bf16 model's holds fp32 master weights, an fp32 "
            f"model's none). Resume with model.params_dtype {dtypes[0]}, or start a new run (fresh optimizer) from the "
            f"checkpoint's weights: checkpoint.save_model writes them to step_N/model/, for model.path")


def _has_key(tree: Any, prefix: str) -> bool:
    """Whether a sharded leaf of `tree` has a key starting with `prefix`."""
    if isinstance(tree, ShardedBase):
        return tree.key.startswith(prefix)
    children = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, list) else ()
    return any(_has_key(value, prefix) for value in children)


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


RESHARDABLE = (ACTOR, OPTIMIZER, REFERENCE)


def check_layout_change(names: list[str], saved: dict[str, int], current: dict[str, int]) -> None:
    """Refuse a TP or PP change for a checkpoint with layout-bound modules (e.g. the subspace constraint)."""
    bound = [name for name in names if name not in RESHARDABLE]
    if bound and (saved["tp"], saved["pp"]) != (current["tp"], current["pp"]):
        raise ValueError(f"the checkpoint's {bound} state resumes only at the tensor and pipeline parallel sizes it "
                         f"was saved at (tp {saved['tp']} x pp {saved['pp']}), not tp {current['tp']} x pp {current['pp']}")
