"""SGLang's tensor payloads: ForkingPickler bytes out, an allowlisting unpickler in.

`/update_weights_from_tensor` carries, per server TP rank, base64 of `ForkingPickler` bytes
(SGLang `MultiprocessingSerializer`). With `torch.multiprocessing`'s reductions a tensor pickles as
a *handle* to its storage, not its bytes: a CUDA-IPC handle on GPU, and on CPU (the
"file_system" sharing strategy used here) the name of a `/dev/shm` segment that the receiving
process maps. The bytes therefore never pass through HTTP, and the sender must keep the tensors
alive until the receiver has answered.

Two payload shapes (SGLang `load_format`):
  - null: `[(hf_name, tensor), ...]`;
  - "flattened_bucket": `{"flattened_tensor": [N] uint8, "metadata": [FlattenedTensorMetadata]}`,
    the layout of SGLang's `srt/weight_sync/tensor_bucket.py`: each tensor's raw bytes
    concatenated, `start_idx`/`end_idx`/`numel` counted in bytes.

Metadata entries pickle as `types.SimpleNamespace` with SGLang's field names (name, shape as
`torch.Size`, dtype as `torch.dtype`, start_idx, end_idx, numel), so a real SGLang server (which reads
them by attribute) and `SafeUnpickler` below both accept them without naming a class of ours.
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import pickle
import sys
import threading
import types
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing
from torch.multiprocessing.reductions import StorageWeakRef

NamedTensors = list[tuple[str, torch.Tensor]]


class PayloadError(ValueError):
    """A tensor payload that is malformed or names a global outside the allowlist."""


# ---------------------------------------------------------------- flattened buckets


@dataclass(frozen=True)
class FlattenedTensorMetadata:
    """Where one tensor sits in a flattened bucket (SGLang srt/weight_sync/tensor_bucket.py).

    start_idx/end_idx/numel count bytes of the bucket's 1-D uint8 tensor.
    """

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int

    def __reduce__(self) -> tuple:
        """Pickle as a SimpleNamespace carrying the same attributes (see module doc)."""
        return types.SimpleNamespace, (), dict(self.__dict__)

    @classmethod
    def parse(cls, raw: Any, bucket_bytes: int) -> FlattenedTensorMetadata:
        """Validate one unpickled metadata entry (anything with SGLang's attributes) against a bucket of `bucket_bytes`."""
        try:
            meta = cls(str(raw.name), torch.Size(raw.shape), raw.dtype, int(raw.start_idx), int(raw.end_idx),
                       int(raw.numel))
        except (AttributeError, TypeError, ValueError) as error:
            raise PayloadError(f"flattened_bucket metadata entry {raw!r} is malformed: {error}") from error
        if not isinstance(meta.dtype, torch.dtype):
            raise PayloadError(f"flattened_bucket: tensor {meta.name} has dtype {meta.dtype!r}, not a torch.dtype")
        nbytes = meta.shape.numel() * meta.dtype.itemsize
        if not (0 <= meta.start_idx and meta.end_idx - meta.start_idx == meta.numel == nbytes and meta.end_idx <= bucket_bytes):
            raise PayloadError(
                f"flattened_bucket: tensor {meta.name} ({tuple(meta.shape)}, {meta.dtype}) needs {nbytes} bytes, but its "
                f"metadata says bytes [{meta.start_idx}, {meta.end_idx}) numel {meta.numel} of a {bucket_bytes}-byte bucket"
            )
        return meta


def flattened_layout(named_tensors: Sequence[tuple[str, torch.Tensor]], align: int = 1) -> list[FlattenedTensorMetadata]:
    """Byte layout of `named_tensors` concatenated in order, each starting at a multiple of `align` bytes
    (1, SGLang's layout: no padding)."""
    layout, start = [], 0
    for name, tensor in named_tensors:
        start = -(-start // align) * align
        layout.append(FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, start, start + tensor.nbytes, tensor.nbytes))
        start += tensor.nbytes
    return layout


def flatten_bucket(
    named_tensors: Sequence[tuple[str, torch.Tensor]], out: torch.Tensor | None = None, align: int = 1
) -> dict[str, Any]:
    """SGLang's "flattened_bucket" dict: {flattened_tensor: [N bytes] uint8, metadata: [FlattenedTensorMetadata]}
    in the `flattened_layout` of `align`.

    The bytes go to a fresh buffer on the first tensor's device, or to the front of `out` ([>= N] uint8,
    e.g. a `shared_buffer` reused for every bucket), never into the caller's tensors' storage.
    """
    layout = flattened_layout(named_tensors, align)
    nbytes = layout[-1].end_idx if layout else 0
    if out is not None and out.numel() < nbytes:
        raise ValueError(f"flatten_bucket: the bucket needs {nbytes} bytes, the buffer holds {out.numel()}")
    device = named_tensors[0][1].device if named_tensors else None
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device) if out is None else out[:nbytes]
    for meta, (_, tensor) in zip(layout, named_tensors):
        flat[meta.start_idx : meta.end_idx].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
    return {"flattened_tensor": flat, "metadata": layout}


def unflatten_bucket(flat: torch.Tensor, metadata: Sequence[Any]) -> NamedTensors:
    """Tensors of `flat` ([N] uint8) per metadata entry, validated, with their shapes and dtypes.

    Views into `flat` where a tensor starts at a multiple of its element size; copies elsewhere (the
    layout has no padding, so mixed dtypes can leave a tensor misaligned).
    """
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise PayloadError(f"flattened_bucket: flattened_tensor must be a 1-D uint8 tensor, got {_describe(flat)}")
    out = []
    for raw in metadata:
        meta = FlattenedTensorMetadata.parse(raw, flat.numel())
        chunk = flat[meta.start_idx : meta.end_idx]
        if meta.start_idx % meta.dtype.itemsize:
            chunk = chunk.clone()
        out.append((meta.name, chunk.view(meta.dtype).view(meta.shape)))
    return out


def _describe(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return f"a {obj.dim()}-D {obj.dtype} tensor"
    return type(obj).__name__


# ---------------------------------------------------------------- ForkingPickler out


_SHARING_LOCK = threading.Lock()
_manager_started = False


def _start_shm_manager_detached() -> None:
    """Start torch's `torch_shm_manager` daemon with stdout/stderr on /dev/null.

    torch starts it on the first file_system share, and it inherits our stdio. Every process that maps one
    of our segments stays connected to it, so it outlives us while the servers run: with our pipes, it
    would keep a parent that waits for their end (subprocess.run) waiting until the servers stop.
    """
    global _manager_started
    if _manager_started:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        torch.empty(1).share_memory_()
        _manager_started = True
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)


@contextlib.contextmanager
def _file_system_sharing() -> Iterator[None]:
    """Share CPU storages by /dev/shm segment name while pickling, so any process on this host can map them
    (the default "file_descriptor" strategy passes descriptors to our own child processes only). The
    strategy is process-global, hence the lock and the restore."""
    with _SHARING_LOCK:
        previous = torch.multiprocessing.get_sharing_strategy()
        torch.multiprocessing.set_sharing_strategy("file_system")
        try:
            _start_shm_manager_detached()
            yield
        finally:
            torch.multiprocessing.set_sharing_strategy(previous)


SHARED_MEMORY_DIR = "/dev/shm"


class SharedMemoryError(RuntimeError):
    """/dev/shm has too little room for what is to be shared (a write past it would kill the process with SIGBUS)."""


def _require_shared_memory(nbytes: int, what: str) -> None:
    stats = os.statvfs(SHARED_MEMORY_DIR)
    free = stats.f_bavail * stats.f_frsize
    if nbytes > free:
        raise SharedMemoryError(
            f"{what} needs {nbytes / 2**20:.0f} MiB of shared memory, {SHARED_MEMORY_DIR} has {free / 2**20:.0f} MiB free: "
            f"enlarge it (docker run --shm-size), or set rollout.weight_sync.payload flattened_bucket with a smaller "
            f"rollout.weight_sync.bucket_mb (two buckets are staged there), or use rollout.weight_sync.method "
            f"distributed. A trainer that was killed leaves its segments there until the servers it pushed to exit"
        )


def shared_buffer(nbytes: int) -> torch.Tensor:
    """[nbytes] uint8 already in /dev/shm: buckets written here are sent without another copy (and, reused,
    without page faults). SharedMemoryError if /dev/shm has no room for it."""
    _require_shared_memory(nbytes, "a weight-push staging buffer")
    with _file_system_sharing():
        return torch.empty(nbytes, dtype=torch.uint8).share_memory_()


_MOVED_BY_US: dict[int, StorageWeakRef] = {}  # StorageImpl address -> weak ref: the storages share_storages moved


def share_storages(tensors: Iterable[torch.Tensor]) -> int:
    """Move the CPU storages of `tensors` into /dev/shm in place, shared by name as `serialize` shares them
    (one copy now; every view, e.g. Megatron's parameters and their DDP hooks, stays valid). From then on
    `maps_without_copy` holds for them and pushes send handles to these storages instead of staging their
    bytes. A shared storage can no longer be resized (freed in place). Storages that are already shared
    otherwise (by descriptor, a mapped file) are left as they are, and staged. Returns the bytes moved;
    SharedMemoryError, before moving any, if /dev/shm has no room for them."""
    storages: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if tensor.device.type == "cpu" and storage.nbytes() and not storage.is_shared():
            storages.setdefault(storage.data_ptr(), storage)
    moved = sum(storage.nbytes() for storage in storages.values())
    _require_shared_memory(moved,
                           "keeping the trainer's weights in shared memory (rollout.weight_sync.payload per_tensor)")
    with _file_system_sharing():
        for storage in storages.values():
            storage.share_memory_()
    for address in [a for a, ref in _MOVED_BY_US.items() if ref.expired()]:
        del _MOVED_BY_US[address]
    _MOVED_BY_US.update((storage._cdata, StorageWeakRef(storage)) for storage in storages.values())
    return moved


def maps_without_copy(tensor: torch.Tensor) -> bool:
    """Whether `serialize` sends `tensor` as a handle to its own storage, leaving it where it is: a contiguous
    CUDA tensor (CUDA-IPC), or a contiguous CPU tensor whose storage `share_storages` moved to /dev/shm."""
    if not tensor.is_contiguous():
        return False
    if tensor.is_cuda:
        return True
    moved = _MOVED_BY_US.get(tensor.untyped_storage()._cdata)
    return tensor.device.type == "cpu" and moved is not None and not moved.expired()


def serialize(obj: Any) -> str:
    """base64 text of `obj` pickled by ForkingPickler: CPU tensors move to shared memory and travel as handles.

    Keep `obj` alive until the receiver has answered. Each call adds one reference for one receiver, so
    call it once per receiving TP rank.
    """
    buffer = io.BytesIO()
    with _file_system_sharing():
        ForkingPickler(buffer).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


# ---------------------------------------------------------------- allowlisted unpickling in


def _torch_dtype_names() -> frozenset[str]:
    return frozenset(name for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype))


ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch.multiprocessing.reductions", "rebuild_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
        ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
        ("torch.storage", "UntypedStorage"),
        ("torch", "Tensor"),
        ("torch", "Size"),
        ("types", "SimpleNamespace"),
        *(("torch", name) for name in _torch_dtype_names()),
    }
)


# CUDA tensors travel as CUDA-IPC handles (`reduce_tensor` names the typed storage class), accepted by a
# server whose engine runs on a GPU of this host.
CUDA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {("torch.multiprocessing.reductions", "rebuild_cuda_tensor"), ("torch.storage", "TypedStorage")}
)


class SafeUnpickler(pickle.Unpickler):
    """Resolves only `ALLOWED_GLOBALS` (plus `CUDA_GLOBALS` if `allow_cuda`): CPU tensor rebuilds from
    shared memory, storages, dtypes, Size and SimpleNamespace. Anything else (os.system, eval, an
    fd-passing rebuild, a CUDA-IPC one on a CPU server) is refused."""

    def __init__(self, file: io.BytesIO, *, allow_cuda: bool = False) -> None:
        super().__init__(file)
        self.allowed = ALLOWED_GLOBALS | CUDA_GLOBALS if allow_cuda else ALLOWED_GLOBALS
        self.allow_cuda = allow_cuda

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.allowed:
            tensors = "CPU tensors shared through /dev/shm with torch's file_system strategy" + (
                " or CUDA tensors as CUDA-IPC handles" if self.allow_cuda else "")
            raise PayloadError(
                f"tensor payload refers to {module}.{name}, which this server does not unpickle (allowed: {tensors}, "
                f"torch dtypes, torch.Size, types.SimpleNamespace); send tensors with megatron_armor's SGLang client "
                f"or SGLang's MultiprocessingSerializer from a process on this host"
                + ("" if self.allow_cuda else " (CUDA tensors only to a server started with --device cuda)")
            )
        return super().find_class(module, name)


def deserialize(text: str, *, allow_cuda: bool = False) -> Any:
    """Inverse of `serialize`; PayloadError for bad base64, a truncated pickle or a global outside the
    allowlist (CUDA-IPC rebuilds only if `allow_cuda`)."""
    try:
        data = base64.b64decode(text, validate=True)
    except (TypeError, ValueError) as error:
        raise PayloadError(f"tensor payload is not base64 text: {error}") from error
    try:
        return SafeUnpickler(io.BytesIO(data), allow_cuda=allow_cuda).load()
    except PayloadError:
        raise
    except (pickle.UnpicklingError, EOFError, RuntimeError, TypeError, ValueError, AttributeError) as error:
        raise PayloadError(f"tensor payload could not be unpickled: {type(error).__name__}: {error}") from error


def named_tensors_from_payload(payload: Any, load_format: str | None) -> NamedTensors:
    """One decoded TP-rank payload -> [(hf_name, tensor)] (views into shared memory: copy before dropping them)."""
    if load_format == "flattened_bucket":
        if not isinstance(payload, dict) or set(payload) != {"flattened_tensor", "metadata"}:
            raise PayloadError(f"flattened_bucket payload must be a dict with keys flattened_tensor and metadata, "
                               f"got {_describe(payload)} {sorted(payload) if isinstance(payload, dict) else ''}")
        return unflatten_bucket(payload["flattened_tensor"], payload["metadata"])
    if load_format is not None:
        raise PayloadError(f"load_format {load_format!r} is not supported; use null or 'flattened_bucket'")
    if not isinstance(payload, list) or not all(
        isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[1], torch.Tensor) for item in payload
    ):
        raise PayloadError(f"a load_format null payload must be a list of (name, tensor) pairs, got {_describe(payload)}")
    return [(str(name), tensor) for name, tensor in payload]
