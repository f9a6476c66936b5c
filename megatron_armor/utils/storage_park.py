"""Device memory handed back without losing the tensors that use it: storages freed and restored in place.

`StoragePark` copies the storages of a set of tensors to one host buffer and frees them
(`UntypedStorage.resize_(0)`, as Megatron frees its grad buffers); `restore` reallocates them and
copies the bytes back. Every view (a parameter, `main_grad`, an optimizer state tensor) stays the same
Python object and is valid again after the restore, so nothing that holds one needs rewiring. Reading a
parked tensor reads freed memory: callers keep parked tensors out of use.

Used by the trainer's offload (`trainer/colocation/offload.py`) and by serve-local's memory release
(`rollout/local_server.py`, which parks without keeping the values, as SGLang's memory saver does
without --enable-weights-cpu-backup).

Host memory: one flat buffer, exactly the parked size and reused while that holds; for a CUDA device it
is page-locked with cudaHostRegister (torch's pinned allocator would round the request up to a power
of two).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class _Parked:
    storage: torch.UntypedStorage  # resized to 0 bytes while parked
    offset: int  # of its bytes in the host buffer
    nbytes: int


class StoragePark:
    """The storages of `tensors()` on `device` (deduplicated), freed and restored in place.

    `tensors` is called at every `park`: tensors that appeared (or were replaced, e.g. by an optimizer's
    `load_state_dict`) since the last one are included. Storages on other devices (e.g. torch's CPU
    `step` counters of a GPU optimizer) stay where they are.
    """

    def __init__(self, tensors: Callable[[], Iterable[torch.Tensor]], device: torch.device) -> None:
        self.tensors, self.device = tensors, device
        self.parked: list[_Parked] | None = None  # None: resident
        self.kept_values = False  # whether the parked bytes are in `host`
        self.host = torch.empty(0, dtype=torch.uint8)  # [bytes of the last park that kept values]

    @property
    def is_parked(self) -> bool:
        return self.parked is not None

    @property
    def parked_bytes(self) -> int:
        return sum(entry.nbytes for entry in self.parked) if self.parked else 0

    def resident_bytes(self) -> int:
        """Bytes of the storages `park` would free now (0 while parked)."""
        return sum(storage.nbytes() for storage in self._live_storages())

    def park(self, *, keep_values: bool = True) -> None:
        """Free every live storage, first copying it to the host buffer if `keep_values` (nothing when
        already parked). Without `keep_values` the storages come back uninitialised."""
        if self.parked is not None:
            return
        parked, offset = [], 0
        for storage in self._live_storages():
            parked.append(_Parked(storage, offset, storage.nbytes()))
            offset += storage.nbytes()
        if keep_values:
            if self.host.numel() != offset:
                self.host = _host_buffer(offset, pinned=self.device.type == "cuda")
            for entry in parked:
                self.host[entry.offset: entry.offset + entry.nbytes].copy_(_as_bytes(entry.storage), non_blocking=True)
            _synchronize(self.device)
        for entry in parked:
            entry.storage.resize_(0)
        self.parked, self.kept_values = parked, keep_values

    def restore(self) -> None:
        """Reallocate every parked storage and, if the park kept them, copy its bytes back (nothing when resident)."""
        if self.parked is None:
            return
        for entry in self.parked:
            entry.storage.resize_(entry.nbytes)
            if self.kept_values:
                _as_bytes(entry.storage).copy_(self.host[entry.offset: entry.offset + entry.nbytes], non_blocking=True)
        _synchronize(self.device)
        self.parked = None

    def _live_storages(self) -> list[torch.UntypedStorage]:
        """The allocated storages of `tensors()` on `device`, each once."""
        storages: dict[int, torch.UntypedStorage] = {}
        for tensor in self.tensors():
            storage = tensor.untyped_storage()
            if storage.nbytes() and storage.device == self.device:  # empty: nothing to free
                storages.setdefault(storage.data_ptr(), storage)
        return list(storages.values())


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """[nbytes] uint8 view of `storage` (valid while its size holds)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _host_buffer(nbytes: int, *, pinned: bool) -> torch.Tensor:
    """[nbytes] uint8 in host memory; `pinned` page-locks exactly these bytes (cudaHostRegister, released
    with the buffer) for asynchronous copies."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if pinned and nbytes:
        cudart = torch.cuda.cudart()
        try:
            torch.cuda.check_error(cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0))
        except torch.cuda.CudaError as error:
            raise RuntimeError(f"page-locking {nbytes / 2**30:.2f} GiB of host memory (cudaHostRegister) for parked "
                               f"device memory failed: {error}") from error
        weakref.finalize(buffer, cudart.cudaHostUnregister, buffer.data_ptr())
    return buffer


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
