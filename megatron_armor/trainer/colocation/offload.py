"""The trainer's side of the colocated memory hand-off (`rollout.memory.offload_trainer`).

Colocated placement shares each GPU between a trainer rank and an SGLang server. `MemoryHandoff`
frees the servers' memory for every training phase; this module frees the trainer's for the rollout
phase. Parts, parked and restored on their own:

  - each model's weights: the actor, the reference, an in-process OPD teacher;
  - the training state: the optimizer's state (Adam moments) and its own parameter copies (fp32
    master weights of a bf16 model), and a subspace constraint's W0 and bases;
  - grads: DDP's grad buffers, whose contents are dropped (they are zero between optimizer steps)
    through Megatron's own `offload_grad_buffers` / `restore_grad_buffers`.

A rollout phase parks everything; a training phase restores everything and, at its end, parks all
but the actor's weights, which the weight push (and the MIPU gate) read before they are parked too.
Pushes of a parked model bring back that model alone.

Storages are freed in place by `utils.storage_park.StoragePark` (one page-locked host buffer per
part, reused from step to step): every view stays valid once restored, so optimizer groups and DDP
hooks need no rewiring. The trainer touches the models only inside the phases of `TrainerOffload`,
and a forward pass of a parked model raises `ParkedWeightsError`. On CPU the host copy is as large as
what it frees: the code path is the GPU's, the saving is not.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator, Mapping

import torch

from megatron_armor.algorithms import ACTOR
from megatron_armor.diagnostics.subspace import SubspaceConstraint
from megatron_armor.distributed.device import training_device
from megatron_armor.utils.storage_park import StoragePark


class ParkedWeightsError(RuntimeError):
    """A forward pass of a model whose weights are parked (a trainer bug, never a user error)."""


class TrainerOffload:
    """Weights, optimizer state and grad buffers of one trainer rank, on the device only when needed.

    The actor's weights (under its policy's name, `algorithms.ACTOR`: the DDP-wrapped module's) and each of the
    `frozen` models' (by their policies' names) park separately. `seconds` accumulates park and restore time until
    `metrics`.
    """

    def __init__(
        self, ddp: torch.nn.Module, optimizer, frozen: Mapping[str, torch.nn.Module],
        constraint: SubspaceConstraint | None = None,
    ) -> None:
        device = training_device()
        self.ddp, self.on_gpu = ddp, device.type == "cuda"
        modules = {ACTOR: ddp.module, **frozen}
        self.frozen = tuple(frozen)  # the models parked again after a training phase
        self.weights = {name: StoragePark(_parameters_of(module), device) for name, module in modules.items()}
        for name, module in modules.items():
            module.register_forward_pre_hook(self._weights_check(name))
        actor_ids = {id(p) for p in ddp.module.parameters()}
        constraint_tensors = (lambda: [*constraint.initial.values(), *constraint.bases.values()]) if constraint else list
        self.training_state = StoragePark(
            lambda: itertools.chain(optimizer_tensors(optimizer, skip=actor_ids), constraint_tensors()), device
        )
        self.grads_parked = False
        self.seconds = 0.0
        self.parked_bytes = 0  # by the last full park (grad buffers included)
        self.reserved_after_park = 0  # bytes the CUDA caching allocator still held after it

    def park(self) -> None:
        """Nothing of the trainer on the device (the rollout phase; idempotent)."""
        with self._timed():
            self._park_training_state()
            for park in self.weights.values():
                park.park()
        self.parked_bytes = sum(park.parked_bytes for park in (self.training_state, *self.weights.values()))
        self.parked_bytes += sum(buffer.grad_data.numel() * buffer.grad_data.element_size()
                                 for buffer in _grad_buffers(self.ddp))
        if self.on_gpu:
            self.reserved_after_park = torch.cuda.memory_reserved()

    def restore(self) -> None:
        """Everything back on the device (idempotent)."""
        with self._timed():
            for park in (*self.weights.values(), self.training_state):
                park.restore()
            if self.grads_parked:
                self.ddp.restore_grad_buffers(synchronize=self.on_gpu)  # reallocated and zeroed
                self.grads_parked = False

    @contextlib.contextmanager
    def training_phase(self) -> Iterator[None]:
        """Everything resident inside; after it all but the actor's weights are parked again."""
        self.restore()
        try:
            yield
        finally:
            with self._timed():
                self._park_training_state()
                for name in self.frozen:
                    self.weights[name].park()

    @contextlib.contextmanager
    def weights_resident(self, *names: str) -> Iterator[None]:
        """The named models' weights on the device inside the block; those parked before are parked after."""
        parked = [self.weights[name] for name in names if self.weights[name].is_parked]
        with self._timed():
            for park in parked:
                park.restore()
        try:
            yield
        finally:
            with self._timed():
                for park in parked:
                    park.park()

    def metrics(self) -> dict[str, float]:
        """Park/restore time since the last call, GiB parked by the last rollout phase's park and (GPU)
        what the caching allocator still reserves after it."""
        metrics = {"perf/trainer_offload_seconds": self.seconds, "memory/trainer_parked_gib": self.parked_bytes / 2**30}
        if self.on_gpu:
            metrics["memory/trainer_gpu_reserved_gib"] = self.reserved_after_park / 2**30
        self.seconds = 0.0
        return metrics

    def _park_training_state(self) -> None:
        self.training_state.park()
        if not self.grads_parked:
            self.ddp.offload_grad_buffers(synchronize=self.on_gpu, empty_cache=False)
            self.grads_parked = True

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        start = time.perf_counter()
        yield
        if self.on_gpu:
            torch.cuda.empty_cache()  # hand the freed blocks to the colocated server
        self.seconds += time.perf_counter() - start

    def _weights_check(self, name: str) -> Callable:
        def check(module: torch.nn.Module, args) -> None:
            if self.weights[name].is_parked:
                raise ParkedWeightsError(f"forward pass of the {name} model while its weights are parked "
                                         f"(rollout.memory.offload_trainer): a trainer bug, restore them first")
        return check


def optimizer_tensors(optimizer, skip: set[int] = frozenset()) -> Iterator[torch.Tensor]:
    """The tensors of a Megatron optimizer (chained or not): every inner torch optimizer's state and
    its parameters (the fp32 master weights of a bf16 model), except those whose id is in `skip`
    (a model's own parameters, which an fp32 model's optimizer updates in place)."""
    for megatron_optimizer in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(megatron_optimizer, "optimizer", None)  # None: a stub (no parameters on this rank)
        if inner is None:
            continue
        for group in inner.param_groups:
            yield from (p for p in group["params"] if id(p) not in skip)
        for state in inner.state.values():
            yield from (value for value in state.values() if isinstance(value, torch.Tensor))


def _parameters_of(module: torch.nn.Module) -> Callable[[], Iterator[torch.Tensor]]:
    return lambda: module.parameters()


def _grad_buffers(ddp) -> list:
    return list(ddp.buffers) + list(ddp.expert_parallel_buffers)
