"""The trainer's side of the colocated memory hand-off (`rollout.offload_trainer`).

Colocated placement shares each GPU between a trainer rank and an SGLang server. `MemoryHandoff`
frees the servers' memory for every training phase; this module frees the trainer's for the rest of
the step (rollouts, weight pushes, validation). Three parts, parked and restored on their own:

  - weights: the parameters of the actor, the reference and an in-process OPD teacher;
  - optimizer: the optimizer's state (Adam moments) and its own parameter copies (fp32 master
    weights of a bf16 model);
  - grads: DDP's grad buffers, whose contents are dropped (they are zero between optimizer steps)
    through Megatron's own `offload_grad_buffers` / `restore_grad_buffers`.

Storages are freed in place (`UntypedStorage.resize_(0)`, as Megatron frees its grad buffers): every
view (a parameter, `main_grad`, an optimizer state tensor) stays the same Python object and is valid
again once its storage is restored, so nothing that holds one (optimizer groups, DDP hooks) needs
rewiring. Reading a parked tensor reads freed memory (a crash, or garbage on a GPU), as with
Megatron's freed grad buffers: the trainer touches the models only inside the phases of
`TrainerOffload`, and a forward pass of a parked model raises `ParkedWeightsError`. On CPU the host
copy is as large as what it frees: the code path is the GPU's, the saving is not.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch


class ParkedWeightsError(RuntimeError):
    """A forward pass of a model whose weights are parked (a trainer bug, never a user error)."""


@dataclass
class _ParkedStorage:
    storage: torch.UntypedStorage  # the device storage, resized to 0 bytes while parked
    host: torch.UntypedStorage  # its bytes on the host (pinned when the storage is on a GPU)


class StoragePark:
    """The device storages of `tensors()` (deduplicated), copied to the host and freed, then restored in place.

    `tensors` is called at every `park`: optimizer state that appeared (or was replaced by a
    `load_state_dict`) since the last one is included. Host buffers are kept and reused while the
    storages keep their sizes.
    """

    def __init__(self, tensors: Callable[[], Iterable[torch.Tensor]]) -> None:
        self.tensors = tensors
        self.parked: list[_ParkedStorage] | None = None  # None: resident
        self._host: list[torch.UntypedStorage] = []  # the last cycle's host buffers, reused when sizes match

    @property
    def is_parked(self) -> bool:
        return self.parked is not None

    def park(self) -> int:
        """Copy every live storage to the host and free it; returns the bytes freed (0 when already parked)."""
        if self.parked is not None:
            return 0
        storages: dict[int, torch.UntypedStorage] = {}
        for tensor in self.tensors():
            storage = tensor.untyped_storage()
            if storage.nbytes():  # an empty storage: nothing to free (e.g. parked with another part)
                storages.setdefault(storage.data_ptr(), storage)
        parked = []
        for index, storage in enumerate(storages.values()):
            host = self._host[index] if index < len(self._host) else None
            if host is None or host.nbytes() != storage.nbytes():
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.is_cuda).untyped_storage()
            host.copy_(storage, non_blocking=True)
            parked.append(_ParkedStorage(storage, host))
        self._host = [entry.host for entry in parked]
        _synchronize(parked)
        for entry in parked:
            entry.storage.resize_(0)
        self.parked = parked
        return sum(entry.host.nbytes() for entry in parked)

    def restore(self) -> None:
        """Reallocate every parked storage and copy its bytes back (nothing when resident)."""
        if self.parked is None:
            return
        for entry in self.parked:
            entry.storage.resize_(entry.host.nbytes())
            entry.storage.copy_(entry.host, non_blocking=True)
        _synchronize(self.parked)
        self.parked = None


class TrainerOffload:
    """Weights, optimizer state and grad buffers of one trainer rank, on the device only when needed.

    The trainer parks everything when a rollout phase starts (`park`), restores everything for a
    training phase (`training_phase`, which parks the optimizer state and grads again at its end:
    weight pushes and the MIPU gate need the weights only) and brings the weights back for a push
    outside it (`weights_resident`). `seconds` and `bytes_parked` accumulate until read by `metrics`.
    """

    def __init__(self, ddp: torch.nn.Module, optimizer, frozen: Sequence[torch.nn.Module] = ()) -> None:
        actor_params = list(ddp.module.parameters())
        actor_ids = {id(p) for p in actor_params}
        self.ddp = ddp
        self.weights = StoragePark(lambda: itertools.chain(actor_params, *(m.parameters() for m in frozen)))
        for model in (ddp.module, *frozen):
            model.register_forward_pre_hook(self._check_weights_resident)
        self.optimizer = StoragePark(lambda: optimizer_tensors(optimizer, skip=actor_ids))
        self.grads_parked = False
        self.seconds = 0.0
        self.bytes_parked = 0

    def park(self) -> None:
        """Nothing of the trainer on the device (idempotent)."""
        self._timed(self._park_training_state, self.weights.park)

    def restore(self) -> None:
        """Everything back on the device (idempotent)."""
        self._timed(self.weights.restore, self.optimizer.restore, self._restore_grads)

    @contextlib.contextmanager
    def training_phase(self) -> Iterator[None]:
        """Everything resident inside; the optimizer state and grads parked again after (the weights stay)."""
        self.restore()
        try:
            yield
        finally:
            self._timed(self._park_training_state)

    @contextlib.contextmanager
    def weights_resident(self) -> Iterator[None]:
        """The weights on the device inside the block; parked again after if they were parked before."""
        was_parked = self.weights.is_parked
        self._timed(self.weights.restore)
        try:
            yield
        finally:
            if was_parked:
                self._timed(self.weights.park)

    def metrics(self) -> dict[str, float]:
        """Time spent parking and restoring, and GiB parked, since the last call."""
        metrics = {"perf/trainer_offload_seconds": self.seconds, "memory/trainer_parked_gib": self.bytes_parked / 2**30}
        self.seconds, self.bytes_parked = 0.0, 0
        return metrics

    def _park_training_state(self) -> int:
        parked = self.optimizer.park()
        if not self.grads_parked:
            parked += sum(buffer.grad_data.untyped_storage().nbytes() for buffer in _grad_buffers(self.ddp))
            self.ddp.offload_grad_buffers(synchronize=self._on_gpu, empty_cache=False)
            self.grads_parked = True
        return parked

    def _check_weights_resident(self, module: torch.nn.Module, args) -> None:
        if self.weights.is_parked:
            raise ParkedWeightsError(f"forward pass of a {type(module).__name__} whose weights are parked "
                                     f"(rollout.offload_trainer): restore them first (TrainerOffload.weights_resident)")

    def _restore_grads(self) -> None:
        if self.grads_parked:
            self.ddp.restore_grad_buffers(synchronize=self._on_gpu)  # reallocated and zeroed
            self.grads_parked = False

    @property
    def _on_gpu(self) -> bool:
        return next(self.ddp.parameters()).is_cuda

    def _timed(self, *actions: Callable[[], int | None]) -> None:
        """Run park (bytes freed) and restore (None) actions, adding their time and the bytes freed."""
        start = time.perf_counter()
        freed = sum(action() or 0 for action in actions)
        if freed and torch.cuda.is_available():
            torch.cuda.empty_cache()  # hand the freed blocks to the colocated server
        self.bytes_parked += freed
        self.seconds += time.perf_counter() - start


def optimizer_tensors(optimizer, skip: set[int] = frozenset()) -> Iterator[torch.Tensor]:
    """The tensors of a Megatron optimizer (chained or not): every inner torch optimizer's state and
    its parameters (the fp32 master weights of a bf16 model), except those whose id is in `skip`
    (a model's own parameters, which an fp32 model's optimizer updates in place)."""
    for megatron_optimizer in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = megatron_optimizer.optimizer
        for group in inner.param_groups:
            yield from (p for p in group["params"] if id(p) not in skip)
        for state in inner.state.values():
            yield from (value for value in state.values() if isinstance(value, torch.Tensor))


def _grad_buffers(ddp) -> list:
    return list(ddp.buffers) + list(ddp.expert_parallel_buffers)


def _synchronize(parked: list[_ParkedStorage]) -> None:
    if any(entry.storage.is_cuda for entry in parked):
        torch.cuda.synchronize()
