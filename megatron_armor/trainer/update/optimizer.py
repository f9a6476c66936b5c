"""Actor wrapping for training: Megatron DDP + Megatron's Adam optimizer + the warmup schedule.

Megatron's own optimizer runs here on CPU and GPU alike (Adam with decoupled weight decay, global
grad-norm clipping across TP/PP/DP ranks), for fp32 models (`FP32Optimizer`) and bf16 ones (Megatron's
mixed-precision `Float16OptimizerWithFloat16Params` or distributed optimizer: fp32 main grads and master weights,
bf16 weights copied from them after each step). On CPU it falls back to torch's Adam (no apex / Transformer
Engine fused Adam) and its grad clipping goes through adaptation 5 of `distributed.cpu_compat` (bf16:
adaptation 12); on GPU the fused kernels are used when present.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import MegatronOptimizer, get_megatron_optimizer
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig

from megatron_armor.config import OptimizerConfig, SubspaceConfig
from megatron_armor.config.builders import builds
from megatron_armor.convert.weights import splitting_group
from megatron_armor.diagnostics.subspace import Sharding, SubspaceConstraint
from megatron_armor.distributed.cpu_compat import megatron_device_scope


@builds(OptimizerConfig)
def wrap_for_training(
    settings: OptimizerConfig, *, model: GPTModel, distributed: bool = False,
) -> tuple[DistributedDataParallel, MegatronOptimizer]:
    """Wrap `model` in Megatron DDP (fp32 grad buffers, grads all-reduced over data-parallel ranks
    and divided by the loss callback's global token or sequence count) and build its Megatron optimizer from
    the `optimizer` section (`settings`).

    DDP's own NaN/Inf check (which raises) is off: `update_policy` checks every mini-batch's loss and
    reduced gradients before its optimizer step and skips the RL step instead (trainer/update/faults.py).
    Weight decay applies to every parameter, biases and norm weights too, as verl's single-group AdamW
    (armor.md §6); Megatron's own exemption of those needs its scheduler, which is not used here
    (`learning_rate` sets the rate per RL step).

    With `distributed` (optimizer.use_distributed_optimizer as resolved for the run,
    `OptimizerConfig.distributed`) the grads are reduce-scattered instead of all-reduced, each data-parallel
    rank keeps the Adam state (and the fp32 master weights of a bf16 model) of its 1/DP slice of the
    flat parameter buffer only, and the updated slices are all-gathered back into every rank's weights.
    The returned optimizer's `state_dict()` then holds this rank's shard (`ShardedStateOptimizer`).
    """
    config = model.config
    config.finalize_model_grads_func = finalize_model_grads
    with megatron_device_scope():
        ddp = DistributedDataParallel(
            config, DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=distributed,
                check_for_nan_in_grad=False
            ), model
        )
        optimizer = get_megatron_optimizer(
            MegatronOptimizerConfig(
                optimizer="adam",
                lr=settings.lr,
                weight_decay=settings.weight_decay,
                adam_beta1=settings.adam_beta1,
                adam_beta2=settings.adam_beta2,
                adam_eps=settings.adam_eps,
                clip_grad=settings.grad_clip,
                bf16=config.bf16,
                params_dtype=config.params_dtype,
                use_distributed_optimizer=distributed,
            ),
            [ddp],
        )
    return ddp, ShardedStateOptimizer(optimizer) if distributed else optimizer


class ShardedStateOptimizer:
    """A Megatron optimizer built with `use_distributed_optimizer`, whose `state_dict()` is this rank's
    shard of the training state, complete: Megatron's own `DistributedOptimizer.state_dict()` leaves the
    Adam moments out (it saves them through a separate gather to DP rank 0 or a distributed checkpoint).

    `state_dict()` -> {"shards": [per DistributedOptimizer: {"inner": its torch optimizer's state_dict()
    (moments and steps of this rank's slice; live tensors, as torch's), "main_params": the fp32 master
    weights of a bf16 model's slice (empty for fp32 models, whose slices are views of the weights)}]}.
    `load_state_dict` puts them back on the same layout (the same TP x PP x DP and model), bit for bit.
    Everything else (step, param_groups, zero_grad, ...) is the wrapped optimizer's.
    """

    def __init__(self, optimizer: MegatronOptimizer):
        self.megatron_optimizer = optimizer

    def __getattr__(self, name: str):
        return getattr(self.megatron_optimizer, name)

    def _parts(self) -> list:
        """The DistributedOptimizers (a chained optimizer's parts, or the optimizer itself) with parameters here."""
        parts = getattr(self.megatron_optimizer, "chained_optimizers", [self.megatron_optimizer])
        return [part for part in parts if getattr(part, "optimizer", None) is not None]

    def state_dict(self) -> dict:
        return {"shards": [
            {"inner": part.optimizer.state_dict(),
             "main_params": [t for group in part.shard_fp32_from_float16_groups for t in group]}
            for part in self._parts()
        ]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for part, shard in zip(self._parts(), state["shards"], strict=True):
            part.optimizer.load_state_dict(shard["inner"])
            mains = [t for group in part.shard_fp32_from_float16_groups for t in group]
            for main, saved in zip(mains, shard["main_params"], strict=True):
                main.copy_(saved)


def learning_rate(rl_step: int, settings: OptimizerConfig) -> float:
    """lr * min(1, (rl_step + 1) / warmup_steps): linear warmup over `warmup_steps` RL steps, then constant.

    As verl's `constant` style, the schedule advances once per RL step (`update_actor`): every
    mini-batch of RL step `rl_step` (0-based) uses this rate, and a resumed run gets its rate back
    from the step number alone. One step ahead of verl, whose scheduler steps after the update and so
    runs RL step k at k / warmup_steps (its first step at lr 0, an update that changes nothing): here
    the first step already uses lr / warmup_steps and full lr is reached at step warmup_steps - 1.
    """
    if settings.warmup_steps == 0:
        return settings.lr
    return settings.lr * min(1.0, (rl_step + 1) / settings.warmup_steps)


@dataclass
class StepResult:
    """Outcome of one optimizer step: `updated` is False when grads were non-finite (step skipped)."""

    updated: bool
    grad_norm: float


def optimizer_step(
    ddp: DistributedDataParallel, optimizer: MegatronOptimizer, lr: float, constraint: SubspaceConstraint | None = None,
) -> StepResult:
    """Apply the accumulated gradients with learning rate `lr`, then zero the grad buffers.

    A `constraint` (subspace-constrained training) projects the reduced gradients before the step
    or the parameter change after it, per its mode.
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
    if constraint is not None:
        constraint.pre_step()
    with megatron_device_scope():
        updated, grad_norm, _ = optimizer.step()
    if constraint is not None:
        constraint.post_step()
    zero_grads(ddp, optimizer)
    grad_norm = float(grad_norm) if grad_norm is not None else math.nan
    return StepResult(updated=bool(updated) and math.isfinite(grad_norm), grad_norm=grad_norm)


def zero_grads(ddp: DistributedDataParallel, optimizer: MegatronOptimizer) -> None:
    """Discard the accumulated gradients: DDP's grad buffers (main_grad) and the optimizer's grads."""
    ddp.zero_grad_buffer()
    optimizer.zero_grad()


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron optimizer (chained or not) that hold parameters of this rank."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [part.optimizer for part in parts if getattr(part, "optimizer", None) is not None]


@torch.no_grad()
def reset_optimizer(optimizer) -> None:
    """Make `optimizer` (Megatron's, or a `ShardedStateOptimizer`) as it was built, for the model's current weights
    (loaded in place beforehand): the Adam moments and step counts dropped (torch creates them afresh, zero, at the
    next step) and the fp32 master weights of a bf16 model copied from the weights again."""
    megatron = getattr(optimizer, "megatron_optimizer", optimizer)
    for inner in torch_optimizers(megatron):
        inner.state.clear()
        for group in inner.param_groups:
            group.update({"step": 0} if "step" in group else {})  # fused Adams keep the step per group
    with megatron_device_scope():
        megatron.reload_model_params()


@builds(SubspaceConfig)
def run_subspace_constraint(settings: SubspaceConfig, *, model: GPTModel) -> SubspaceConstraint | None:
    """The run's constraint over `model`'s weights as the subspace section says (`subspace_constraint` with its k and
    mode), or None while subspace-constrained training is off."""
    return subspace_constraint(model, settings.k, settings.mode) if settings.enabled else None


def subspace_constraint(model: GPTModel, k: int, mode: str) -> SubspaceConstraint:
    """A `SubspaceConstraint` over the model's 2-D decoder weights (fused qkv / fc1 as Megatron holds
    them; embeddings and the output layer are left free), starting from their current values as W0.

    Under tensor parallelism the bases are those of the full matrices: Megatron marks a split weight
    with `tensor_model_parallel` and its `partition_dim` (0: column-parallel qkv / fc1, 1: row-parallel
    proj / fc2), which become each shard's `Sharding` over the group that splits it (`splitting_group`).
    """
    params = {name: p for name, p in model.named_parameters() if p.dim() == 2 and name.startswith("decoder.")}
    # Megatron keeps the expert weights it splits over the expert-TP group out of the dense reductions (`allreduce`
    # False: under EP, or an expert TP size other than TP); an expert's expert-TP group is the TP group otherwise
    groups = {name: splitting_group(expert=not getattr(p, "allreduce", True))
              for name, p in params.items() if getattr(p, "tensor_model_parallel", False)}
    sharding = {name: Sharding(params[name].partition_dim, group) for name, group in groups.items()
                if torch.distributed.get_world_size(group) > 1}
    return SubspaceConstraint(
        params, {name: p.detach().clone() for name, p in params.items()}, k=k, mode=mode, sharding=sharding
    )

