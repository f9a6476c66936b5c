"""The trainer's side of the colocated memory hand-off (`rollout.offload_trainer`).

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

Storages are freed in place (`UntypedStorage.resize_(0)`, as Megatron frees its grad buffers): every
view (a parameter, `main_grad`, an optimizer state tensor) stays the same Python object and is valid
again once its storage is restored, so nothing that holds one (optimizer groups, DDP hooks) needs
rewiring. Reading a parked tensor reads freed memory (a crash, or garbage on a GPU), as with
Megatron's freed grad buffers: the trainer touches the models only inside the phases of
`TrainerOffload`, and a forward pass of a parked model raises `ParkedWeightsError`.

Host memory: one flat buffer per part, exactly its size and reused from step to step; on a GPU it is
page-locked with cudaHostRegister (torch's pinned allocator would round each request up to a power
of two). On CPU the host copy is as large as what it frees: the code path is the GPU's, the saving
is not.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from megatron_armor.diagnostics.subspace import SubspaceConstraint
from megatron_armor.distributed.device import training_device


class ParkedWeightsError(RuntimeError):
    """A forward pass of a model whose weights are parked (a trainer bug, never a user error)."""


@dataclass(frozen=True)
class _Parked:
    storage: torch.UntypedStorage  # resized to 0 bytes while parked
    offset: int  # of its bytes in the part's host buffer
    nbytes: int


class StoragePark:
    """The storages of `tensors()` on `device` (deduplicated), copied to one host buffer and freed, then
    restored in place.

    `tensors` is called at every `park`: optimizer state that appeared (or was replaced by a
    `load_state_dict`) since the last one is included. Storages elsewhere (e.g. torch's CPU `step`
    counters of a GPU optimizer) stay where they are.
    """

    def __init__(self, tensors: Callable[[], Iterable[torch.Tensor]], device: torch.device) -> None:
        self.tensors, self.device = tensors, device
        self.parked: list[_Parked] | None = None  # None: resident
        self.host = torch.empty(0, dtype=torch.uint8)  # [bytes of the last park], reused while the size holds

    @property
    def is_parked(self) -> bool:
        return self.parked is not None

    @property
    def parked_bytes(self) -> int:
        return sum(entry.nbytes for entry in self.parked) if self.parked else 0

    def park(self) -> None:
        """Copy every live storage to the host buffer and free it (nothing when already parked)."""
        if self.parked is not None:
            return
        storages: dict[int, torch.UntypedStorage] = {}
        for tensor in self.tensors():
            storage = tensor.untyped_storage()
            if storage.nbytes() and storage.device == self.device:  # empty: nothing to free
                storages.setdefault(storage.data_ptr(), storage)
        parked, offset = [], 0
        for storage in storages.values():
            parked.append(_Parked(storage, offset, storage.nbytes()))
            offset += storage.nbytes()
        if self.host.numel() != offset:
            self.host = _host_buffer(offset, pinned=self.device.type == "cuda")
        for entry in parked:
            self.host[entry.offset: entry.offset + entry.nbytes].copy_(_as_bytes(entry.storage), non_blocking=True)
        _synchronize(self.device)
        for entry in parked:
            entry.storage.resize_(0)
        self.parked = parked

    def restore(self) -> None:
        """Reallocate every parked storage and copy its bytes back (nothing when resident)."""
        if self.parked is None:
            return
        for entry in self.parked:
            entry.storage.resize_(entry.nbytes)
            _as_bytes(entry.storage).copy_(self.host[entry.offset: entry.offset + entry.nbytes], non_blocking=True)
        _synchronize(self.device)
        self.parked = None


class TrainerOffload:
    """Weights, optimizer state and grad buffers of one trainer rank, on the device only when needed.

    The actor's weights ("actor", the DDP-wrapped module) and each of the `frozen` models' park
    separately. `seconds` accumulates park and restore time until `metrics`.
    """

    def __init__(
        self, ddp: torch.nn.Module, optimizer, frozen: Mapping[str, torch.nn.Module],
        constraint: SubspaceConstraint | None = None,
    ) -> None:
        device = training_device()
        self.ddp, self.on_gpu = ddp, device.type == "cuda"
        modules = {"actor": ddp.module, **frozen}
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
                for name, park in self.weights.items():
                    if name != "actor":
                        park.park()

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
                                         f"(rollout.offload_trainer): a trainer bug, restore them first")
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


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """[nbytes] uint8 view of `storage` (valid while its size holds)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _host_buffer(nbytes: int, *, pinned: bool) -> torch.Tensor:
    """[nbytes] uint8 in host memory; `pinned` page-locks exactly these bytes (cudaHostRegister, released
    with the buffer) for asynchronous copies, where torch's pinned allocator would round up to a power of two."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if pinned and nbytes:
        cudart = torch.cuda.cudart()
        try:
            torch.cuda.check_error(cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0))
        except torch.cuda.CudaError as error:
            raise RuntimeError(f"rollout.offload_trainer: page-locking {nbytes / 2**30:.2f} GiB of host memory "
                               f"(cudaHostRegister) failed: {error}") from error
        weakref.finalize(buffer, cudart.cudaHostUnregister, buffer.data_ptr())
    return buffer


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
