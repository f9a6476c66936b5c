"""How `SGLangEngine` moves HF-named weights into its servers: one class per SGLang update path.

- `TensorTransport` (weight_sync "tensor", colocated): /update_weights_from_tensor with handles to shared
  memory (CUDA-IPC handles on GPU): to staging buffers, or with load_format null to the trainer's own
  storage where it can be mapped; a bucket lives until every server has answered.
- `DistributedTransport` ("distributed", disaggregated): a process group of the trainer (rank 0) and
  every server TP rank, formed on the first push and again after a failed one; per bucket,
  /update_weights_from_distributed goes to all servers while rank 0 broadcasts (the servers' replies
  come after the broadcast, so both run at once, as slime does). gloo for CPU tensors, NCCL for CUDA ones.
- `DiskTransport` ("disk", fallback): one safetensors file per bucket in a fresh subdirectory of a
  directory the servers can read, then /update_weights_from_disk.

Each `push` draws its tensors lazily (`proto.bucket_named_tensors`) and sends bucket by bucket, so the
trainer's gather runs as the buckets go out and this side holds about two buckets at a time, never the
whole model. Each push ends with flush_cache and the new weight_version on its last request. `close()`
releases what a transport holds on either side; the next push sets it up again.
"""

from __future__ import annotations

import logging
import shutil
import uuid
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from safetensors.torch import save_file

from megatron_armor.config import WeightSyncConfig
from megatron_armor.config.builders import builds
from megatron_armor.rollout import sglang_protocol as proto
from megatron_armor.rollout import tensor_serialization, weight_group
from megatron_armor.utils.net import free_port, local_address_towards

NamedTensors = Iterable[tuple[str, torch.Tensor]]
T = TypeVar("T")
log = logging.getLogger(__name__)


class Server(Protocol):
    url: str
    tp_size: int


PostAll = Callable[[str, Callable[[Any], Any]], None]  # (path, server -> body): POST to every server, raise on failure


class Transport:
    """One SGLang weight-update path: `push` sends a model's tensors, `close` releases the state kept on either
    side (the next push sets it up again).

    servers: the servers pushed to (the engine's list, updated in place); post_all: POST to each of them;
    settings: the rollout.weight_sync section (bucket_bytes, load_format, dir); group_timeout_s: forming the
    distributed group, and each broadcast in it (seconds)."""

    def __init__(
        self, servers: Sequence[Server], post_all: PostAll, settings: WeightSyncConfig, group_timeout_s: float = 300.0,
    ) -> None:
        self.servers, self.post_all, self.settings, self.group_timeout_s = servers, post_all, settings, group_timeout_s

    def push(self, named_tensors: NamedTensors, version: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def release_buffers(self) -> None:
        """Free memory kept on this side only to speed up the next push (nothing by default)."""


class TensorTransport(Transport):
    """A flattened bucket is staged whole; with load_format null only the tensors that cannot be mapped where
    they are (`proto.staged_tensors`: CPU tensors outside shared memory, non-contiguous ones) are, and the
    others go as handles to their own storage, so the servers' copy is the only one. Staging uses two
    buffers of the bucket budget (`bucket_bytes`; a buffer grows when a bucket of one larger tensor needs
    more, and none is made while nothing is staged), kept between pushes: in /dev/shm for CPU tensors (one
    copy on this side, no fresh pages to fault in after the first push), on the tensors' GPU for CUDA ones
    (sent as CUDA-IPC handles; not yet run on a GPU); an offloaded trainer releases them after each push
    (`release_buffers`). While the servers load bucket k, bucket k+1 is drawn and packed into the other
    buffer, so the gather, the copy and the load overlap.

    `close()`, or at the latest interpreter exit, drops the buffers; a CPU buffer's /dev/shm segment goes
    once no process maps it. Except after a failed push: each body adds a reference to the segment that
    its server drops when it unpickles the body, and a server that failed before that leaves it behind.
    It cannot be released here: the client cannot tell whether a failed server unpickled its body, and
    dropping a reference the server already dropped is as wrong as keeping one it did not. Such a segment
    stays until torch's shm manager exits (once this process and the servers that mapped it have). A push
    sends only the two buffers, replaced only by larger ones, and the weights `share_storages` moved (which
    live as long as the trainer anyway), so failures leave at most those behind; so does a trainer killed
    while the servers run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._staging: dict[int, torch.Tensor] = {}  # slot 0/1 -> [>= bucket_bytes] uint8; emptied by the finalizer
        weakref.finalize(self, self._staging.clear)  # also runs at exit, when garbage collection may not

    def push(self, named_tensors: NamedTensors, version: str) -> None:
        load_format = self.settings.load_format
        buckets = proto.bucket_named_tensors(named_tensors, self.settings.bucket_bytes,
                                             proto.payload_align(load_format))
        with ThreadPoolExecutor(1) as sender:
            in_flight = None  # the previous bucket's request and payload (referenced until it is answered)
            for n, (bucket, last) in enumerate(buckets):
                # Slot n % 2 last held bucket n - 2, whose request was answered before bucket n - 1's went out.
                payload = proto.tensor_payload(bucket, load_format, self._buffer(n % 2, bucket))
                if bucket[0][1].is_cuda:  # a server reads the handles without waiting for our stream's kernels
                    torch.cuda.current_stream(bucket[0][1].device).synchronize()  # (packing, the gather)
                bodies = {
                    s.url: proto.update_weights_from_tensor_request(
                        payload, tp_size=s.tp_size, load_format=load_format, flush_cache=last,
                        weight_version=version if last else None,
                    )
                    for s in self.servers
                }
                if in_flight is not None:
                    in_flight[0].result()  # frees the buffer bucket n+1 will be packed into
                in_flight = sender.submit(self.post_all, "/update_weights_from_tensor", lambda s, b=bodies: b[s.url]), payload
            if in_flight is not None:
                in_flight[0].result()

    def _buffer(self, slot: int, bucket: list[tuple[str, torch.Tensor]]) -> torch.Tensor | None:
        """Staging buffer `slot`: uint8 on the bucket's device (shared memory on CPU) holding at least the
        bucket's payload (None if nothing of it is staged). A smaller (or misplaced) one is replaced by one of
        max(payload, min(bucket_bytes, 2 x payload)) bytes: a model smaller than the budget stages in about its
        own size, a large one reaches the budget in a step or two. No request may reference the slot's buffer."""
        needed = proto.payload_bytes(bucket, self.settings.load_format)
        if needed == 0:
            return None
        device = bucket[0][1].device
        buffer = self._staging.get(slot)
        if buffer is None or buffer.numel() < needed or buffer.device != device:
            size = max(needed, min(self.settings.bucket_bytes, 2 * needed))
            self._staging.pop(slot, None)  # release the old buffer before allocating its successor
            buffer = self._staging[slot] = (torch.empty(size, dtype=torch.uint8, device=device) if device.type == "cuda"
                                            else tensor_serialization.shared_buffer(size))
        return buffer

    def close(self) -> None:
        self.release_buffers()

    def release_buffers(self) -> None:
        """Drop the staging buffers (a colocated trainer's rollout phase wants their GPU memory back)."""
        self._staging.clear()
        if torch.cuda.is_initialized():
            torch.cuda.ipc_collect()  # frees CUDA buffers once the servers dropped their handles to them


class DistributedTransport(Transport):
    """The group lives from the push that forms it until a push fails or `close()`; either makes the
    servers leave it, best-effort (a dead or restarted server is in no group). Every formation takes a
    fresh group name, so a server left in an old group never clashes with the new one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group_name: str | None = None  # of the group formed, or being formed
        self._group: torch.distributed.ProcessGroup | None = None
        self._device: torch.device | None = None

    def push(self, named_tensors: NamedTensors, version: str) -> None:
        try:
            for bucket, last in proto.bucket_named_tensors(named_tensors, self.settings.bucket_bytes):
                if self._group is None:  # formed once the first bucket is drawn: its device picks the backend
                    self._device = bucket[0][1].device
                    self._group = self._form_group(weight_group.backend_for_device(self._device))
                update = proto.DistributedUpdate.of(
                    bucket, group_name=self.group_name, load_format=self.settings.load_format, flush_cache=last,
                    weight_version=version if last else None,
                )
                self._with_servers(
                    "/update_weights_from_distributed", lambda s: update.body(),
                    lambda: weight_group.broadcast_from_trainer(self._group, bucket, update.load_format, self._device),
                )
        except BaseException:
            self.close()  # a broken or half-formed group is never reused
            raise

    def _form_group(self, backend: str) -> torch.distributed.ProcessGroup:
        """World = trainer + every server TP rank; server i's ranks start after those of servers 0..i-1."""
        self.group_name = f"armor-weights-{uuid.uuid4().hex[:8]}"
        address = local_address_towards(self.servers[0].url)
        port, world = free_port(address), 1 + sum(s.tp_size for s in self.servers)
        offsets, offset = {}, 1
        for server in self.servers:
            offsets[server.url], offset = offset, offset + server.tp_size
        spec = proto.WeightGroupSpec(address, port, 0, world, self.group_name, backend)
        timeout = timedelta(seconds=self.group_timeout_s)
        return self._with_servers(
            "/init_weights_update_group",
            lambda s: proto.WeightGroupSpec(address, port, offsets[s.url], world, spec.group_name, backend).body(),
            lambda: weight_group.create_as_trainer(spec, timeout),
        )

    def _with_servers(self, path: str, body_for: Callable[[Any], Any], trainer_side: Callable[[], T]) -> T:
        """POST `path` to every server while this thread runs `trainer_side` (the collective they wait in)."""
        with ThreadPoolExecutor(1, thread_name_prefix="sglang-weight-group") as pool:
            replies = pool.submit(self.post_all, path, body_for)
            try:
                result = trainer_side()
            except (RuntimeError, torch.distributed.DistError) as error:
                failure = replies.exception(timeout=self.group_timeout_s)
                raise RuntimeError(f"{path}: the trainer side of group {self.group_name!r} failed ({error}); "
                                   f"servers: {failure or 'no error'}") from error
            replies.result()
        return result

    def close(self) -> None:
        """Drop the group here and ask every server to leave it; a server that cannot is logged, not raised
        (the next push forms a group under another name)."""
        name, self.group_name, self._group = self.group_name, None, None
        if name is None:
            return
        try:
            self.post_all("/destroy_weights_update_group", lambda s: proto.destroy_weights_update_group_request(name))
        except RuntimeError as error:  # the engine's RolloutError naming each server that failed
            log.warning("leaving weight-update group %r: %s", name, error)


class DiskTransport(Transport):
    """Each push writes a fresh subdirectory of rollout.weight_sync.dir, so the servers never read a mix of two pushes;
    the previous push's subdirectory is removed once every server has loaded the new one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self.settings.dir:
            raise ValueError("weight_sync disk needs a directory the servers can read (rollout.weight_sync.dir)")
        self._loaded: Path | None = None  # the subdirectory the servers loaded last

    def push(self, named_tensors: NamedTensors, version: str) -> None:
        """Write model-NNNNN.safetensors bucket by bucket, then every server loads the subdirectory."""
        target = Path(self.settings.dir) / f"push-{uuid.uuid4().hex[:12]}"
        target.mkdir(parents=True)
        try:
            buckets = proto.bucket_named_tensors(named_tensors, self.settings.bucket_bytes)
            for n, (bucket, _) in enumerate(buckets):
                save_file({name: t.detach().cpu().contiguous() for name, t in bucket},
                          str(target / f"model-{n:05d}.safetensors"))
            if not any(target.iterdir()):  # no tensors: nothing to send, as with the other transports
                target.rmdir()
                return
            body = proto.update_weights_from_disk_request(str(target.resolve()), weight_version=version)
            self.post_all("/update_weights_from_disk", lambda s: body)
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise
        self.close()
        self._loaded = target

    def close(self) -> None:
        """Remove the subdirectory the servers loaded last (they hold its weights in memory)."""
        if self._loaded is not None:
            shutil.rmtree(self._loaded, ignore_errors=True)
            self._loaded = None


TRANSPORTS: dict[str, type[Transport]] = {
    "tensor": TensorTransport, "distributed": DistributedTransport, "disk": DiskTransport,
}


@builds(WeightSyncConfig)
def weight_transport(
    settings: WeightSyncConfig, *, servers: Sequence[Server], post_all: PostAll, group_timeout_s: float = 300.0,
) -> Transport:
    """The transport of rollout.weight_sync.method (`TRANSPORTS`) to `servers` (see `Transport`)."""
    return TRANSPORTS[settings.method](servers, post_all, settings, group_timeout_s)
