"""The state behind the SGLang stand-in: a `LocalEngine` plus request bookkeeping.

Implements what each SGLang endpoint does (generation with `n` and a LoRA adapter per item, aborts by rid as
SGLang matches them, pause/continue, weight updates from tensors, disk or a weight-update group, LoRA adapters
loaded from tensors and unloaded, busy refusals, loads, memory release); `http_server` only maps paths and JSON onto it. Generation and weight updates share
one engine lock; requests queued behind it, or held by a pause, count as waiting (held ones not as in
flight).

The engine runs on the CPU (the default) or a GPU of this host (`device`): there it takes tensor
updates as CUDA-IPC handles, joins NCCL weight-update groups and, on a memory release, really frees
the weights' device memory, so the colocated hand-off can be checked on one GPU without SGLang.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from http import HTTPStatus
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from megatron_armor.rollout import sglang_protocol as proto
from megatron_armor.rollout import tensor_serialization, weight_group
from megatron_armor.rollout.base import Generation, SamplingParams
from megatron_armor.rollout.engine_lora import AdapterError
from megatron_armor.rollout.local import LocalEngine
from megatron_armor.utils.storage_park import StoragePark

SERVER_VERSION = "megatron-armor-local"
WEIGHT_GROUP_TIMEOUT = timedelta(seconds=120)  # joining a weight-update group, and each broadcast in it


class RequestError(Exception):
    """A request the server refuses; `status` is the HTTP code to answer with."""

    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.status = status


def _engine_device(device: torch.device | str) -> torch.device:
    """`device` as a concrete CPU or visible GPU (ValueError otherwise)."""
    try:
        device = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"serve-local: device {str(device)!r} is not a device name ({error})") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"serve-local: device must be cpu or cuda[:N], got {str(device)!r}")
    if not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"serve-local: device {str(device)!r} is not a visible GPU "
                         f"({torch.cuda.device_count()} visible)")
    return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)


@dataclass
class _Item:
    """One sequence to generate: a prompt expanded by `n`, with its SGLang options."""

    prompt: list[int]
    sampling: SamplingParams
    rid: str
    no_stop_trim: bool
    return_routed_experts: bool = False
    lora: str | None = None  # the loaded LoRA adapter it samples with (its lora_path); None: the base


class LocalServerState:
    """The engine behind the server plus request bookkeeping (thread-safe)."""

    def __init__(
        self, model_dir: str | Path, *, host: str, port: int, random_seed: int = 0, weights_cpu_backup: bool = False,
        device: torch.device | str = "cpu", return_routed_experts: bool = False,
    ) -> None:
        self.model_path = str(model_dir)
        self.weights_cpu_backup = weights_cpu_backup  # SGLang --enable-weights-cpu-backup
        self.return_routed_experts = return_routed_experts  # SGLang --enable-return-routed-experts
        self.device = _engine_device(device)
        self.host, self.port, self.random_seed = host, port, random_seed
        self.engine: LocalEngine | None = None
        self._weights: StoragePark | None = None  # the engine's weights, freed while "weights" is released
        self.eos_token_id: int | None = None
        self.weight_version = "default"
        self.engine_lock = threading.Lock()  # generation and weight updates
        self._counts = threading.Lock()
        self._changed = threading.Condition(self._counts)  # notified on pause/continue, aborts and finished requests
        self.running = self.waiting = 0
        self.paused = False
        self._held = 0  # waiting requests that arrived while paused and were not aborted
        self._groups: dict[str, torch.distributed.ProcessGroup] = {}  # weight-update groups by name
        self._active: set[str] = set()  # rids of queued and running items
        self._aborted: set[str] = set()  # rid prefixes to abort
        self._abort_epoch = 0
        self.released: set[str] = set()  # memory tags released (/release_memory_occupation) and not resumed
        self.memory_releases = 0
        self.stale_weights: set[str] = set()  # HF names lost by a weights release without CPU backup, not reloaded
        self.loads_without_kv_cache = 0  # weight updates while the KV cache was released (a staged resume)

    def load(self) -> None:
        """Load the model; from here on the server is ready."""
        torch.manual_seed(self.random_seed)
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        with torch.no_grad():
            for param in model.parameters():  # own storages on the device: the loader may map them from the file,
                param.data = param.data.to(self.device, copy=True)  # and a memory release resizes them
        model.to(self.device)  # the buffers
        eos = model.config.eos_token_id
        self.eos_token_id = eos[0] if isinstance(eos, list) else eos
        pad = model.config.pad_token_id
        self._weights = StoragePark(model.parameters, self.device)
        self.engine = LocalEngine(model, pad_token_id=0 if pad is None else pad, record_routes=self.return_routed_experts)

    @property
    def ready(self) -> bool:
        return self.engine is not None

    @property
    def vocab_size(self) -> int:
        return self.engine.model.get_input_embeddings().num_embeddings

    def in_flight(self) -> int:
        """Requests running or queued, less those a pause holds (SGLang holds them before its scheduler)."""
        with self._counts:
            return self.running + self.waiting - self._held

    # ---------------------------------------------------------------- generation

    def generate(self, body: dict[str, Any]) -> Any:
        """POST /generate: a batch (list of lists) gives a list out; one prompt gives one item (a list if n > 1)."""
        for field in ("text", "input_embeds"):
            if body.get(field) is not None:
                raise RequestError(f"/generate: '{field}' needs a tokenizer; this server takes input_ids only")
        if body.get("stream"):
            raise RequestError("/generate: stream=true is not supported by this server")
        input_ids = body.get("input_ids")
        if not input_ids:
            raise RequestError("/generate: input_ids is required (list[int] or list[list[int]])")
        self._require_memory("/generate", "weights", "kv_cache")
        self._require_fresh_weights("/generate")
        single = isinstance(input_ids[0], int)
        prompts = [input_ids] if single else input_ids
        items = self._items(prompts, body)
        epoch = self._enqueue(items)
        try:
            self._wait_while_paused(epoch, items)
            with self.engine_lock, self._running():
                results = self._run(items, lambda: self._aborted_since(epoch, items))
            aborted = self._aborted_since(epoch, items)
        finally:
            self._dequeue(items)
        out = [self._item_body(item, result, item.rid in aborted) for item, result in zip(items, results)]
        return out[0] if single and len(out) == 1 else out

    def _items(self, prompts: list[list[int]], body: dict[str, Any]) -> list[_Item]:
        params = body.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(prompts)
        rids = body.get("rid")
        rids = rids if isinstance(rids, list) else [rids] * len(prompts)
        if len(params) != len(prompts) or len(rids) != len(prompts):
            raise RequestError(f"/generate: sampling_params and rid lists need one entry per prompt ({len(prompts)})")
        routes = bool(body.get("return_routed_experts"))
        if routes and not self.return_routed_experts:
            raise RequestError("/generate: return_routed_experts needs a server started with "
                               "--enable-return-routed-experts")
        adapters = self._lora_paths(body.get("lora_path"), len(prompts))
        items = []
        for prompt, p, rid, lora in zip(prompts, params, rids, adapters):
            self._check_prompt(prompt)
            try:
                options = proto.sampling_from_body(p)
            except (ValueError, TypeError) as error:
                raise RequestError(f"/generate: {error}") from error
            sampling = options.sampling
            if not options.ignore_eos and self.eos_token_id is not None:
                sampling = replace(sampling, stop_token_ids=(*sampling.stop_token_ids, self.eos_token_id))
            base = rid or uuid.uuid4().hex
            items += [
                _Item(list(prompt), sampling, base if options.n == 1 else f"{base}-{j}", options.no_stop_trim, routes,
                      lora)
                for j in range(options.n)
            ]
        return items

    def _lora_paths(self, lora_path: Any, prompts: int) -> list[str | None]:
        """Each prompt's adapter from a request's `lora_path` (one name, or a list with one per prompt; null: the
        base); RequestError (400) for a name no loaded adapter has."""
        paths = lora_path if isinstance(lora_path, list) else [lora_path] * prompts
        if len(paths) != prompts:
            raise RequestError(f"/generate: lora_path lists need one entry per prompt ({prompts})")
        unknown = sorted({str(p) for p in paths if p is not None and p not in self.engine.adapters.loaded})
        if unknown:
            raise RequestError(f"/generate: lora_path {unknown} names no loaded adapter (loaded: "
                               f"{sorted(self.engine.adapters.loaded)}); POST /load_lora_adapter_from_tensors first")
        return paths

    def _check_prompt(self, prompt: Any) -> None:
        """RequestError (400) unless `prompt` is a non-empty list of ids in [0, vocab_size)."""
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) for t in prompt):
            raise RequestError("/generate: every prompt must be a non-empty list of token ids")
        outside = [t for t in prompt if not 0 <= t < self.vocab_size]
        if outside:
            raise RequestError(f"/generate: input_ids {outside[:8]} are outside the vocabulary [0, {self.vocab_size})")

    def _run(self, items: list[_Item], aborted: Callable[[], set[str]]) -> list[Generation | None]:
        """Generate every item, one engine call per distinct (SamplingParams, adapter); an item whose rid `aborted()`
        names stops where it is (SGLang's abort: its tokens so far come back), one named before it began is None."""
        results: list[Generation | None] = [None] * len(items)
        groups: dict[tuple[SamplingParams, str | None], list[int]] = {}
        skip = aborted()
        for i, item in enumerate(items):
            if item.rid not in skip:
                groups.setdefault((item.sampling, item.lora), []).append(i)
        for (sampling, lora), rows in groups.items():

            def stopped(rows=rows) -> list[int]:
                names = aborted()
                return [k for k, row in enumerate(rows) if items[row].rid in names] if names else []

            generations = self.engine.generate([items[r].prompt for r in rows], sampling, abort=stopped, lora=lora)
            for row, generation in zip(rows, generations):
                results[row] = generation
        return results

    def _item_body(self, item: _Item, generation: Generation | None, aborted: bool) -> dict[str, Any]:
        ids = generation.response_ids if generation else []
        logprobs = generation.logprobs if generation else []
        if aborted:
            finish = proto.finish_reason_body("abort", message="Abort request by the client")
        elif generation.finish_reason == "stop":
            finish = proto.finish_reason_body("stop", stop_token=ids[-1])
        else:
            finish = proto.finish_reason_body("length", length=len(ids))
        routes = generation.routed_experts if generation and item.return_routed_experts else None
        body = proto.generate_item_body(item.rid, len(item.prompt), ids, logprobs, finish, self.weight_version, routes)
        if finish["type"] == "stop" and not item.no_stop_trim:
            body["output_ids"] = ids[:-1]
        return body

    # ---------------------------------------------------------------- aborts

    def abort(self, body: dict[str, Any]) -> None:
        """POST /abort_request {rid, abort_all}: queued victims are skipped, running ones end with type abort.

        As in SGLang, a `rid` that is not the rid of an item in flight is ignored (the tokenizer manager's
        check; a batch's bare rid names none of its items), and one that is aborts every item whose rid
        starts with it (the scheduler's match: "q-1" also aborts "q-10").
        """
        with self._counts:
            rid = str(body.get("rid") or "")
            if body.get("abort_all"):
                self._abort_epoch += 1
            elif rid in self._active:
                self._aborted.add(rid)
            self._changed.notify_all()

    def _aborted_since(self, epoch: int, items: list[_Item]) -> set[str]:
        with self._counts:
            return self._aborted_locked(epoch, items)

    def _aborted_locked(self, epoch: int, items: list[_Item]) -> set[str]:
        if self._abort_epoch != epoch:
            return {item.rid for item in items}
        return {item.rid for item in items if any(item.rid.startswith(a) for a in self._aborted)}

    # ---------------------------------------------------------------- pause and continue

    def pause_generation(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /pause_generation {mode}: new and queued requests wait for /continue_generation.

        mode abort (SGLang's default) also aborts every request in flight and answers once the server
        is idle; retract and in_place keep them (this engine cannot stop a running batch mid-way, so the
        running one finishes; the queued ones run after /continue_generation).
        """
        mode = body.get("mode", "abort")
        proto.pause_generation_request(mode)
        with self._counts:
            self.paused = True
            if mode == "abort":
                self._abort_epoch += 1
                self._changed.notify_all()
                while self.running + self.waiting > self._held:  # every request aborted above has returned
                    self._changed.wait()
        return {"message": "Generation paused.", "status": "ok"}

    def continue_generation(self, _: dict[str, Any]) -> dict[str, Any]:
        with self._counts:
            self.paused = False
            self._changed.notify_all()
        return {"message": "Generation continued.", "status": "ok"}

    def _wait_while_paused(self, epoch: int, items: list[_Item]) -> None:
        """Hold a request while the server is paused, unless all its items are aborted meanwhile (an item not
        aborted stays paused, as in SGLang's scheduler)."""
        with self._counts:
            if not self.paused or len(self._aborted_locked(epoch, items)) == len(items):
                return
            self._held += 1
            self._changed.notify_all()  # a pause waiting for the server to go idle counts held requests as idle
            while self.paused and len(self._aborted_locked(epoch, items)) < len(items):
                self._changed.wait()
            self._held -= 1

    def _enqueue(self, items: list[_Item]) -> int:
        """Count a request as waiting; returns the abort_all epoch it entered in."""
        with self._counts:
            self.waiting += 1
            self._active.update(item.rid for item in items)
            return self._abort_epoch

    @contextlib.contextmanager
    def _running(self) -> Iterator[None]:
        """Move the request from waiting to running for the duration (the caller holds the engine)."""
        with self._counts:
            self.waiting -= 1
            self.running += 1
        try:
            yield
        finally:
            with self._counts:
                self.running -= 1

    def _dequeue(self, items: list[_Item]) -> None:
        with self._counts:
            self._active.difference_update(item.rid for item in items)
            self._aborted = {a for a in self._aborted if any(r.startswith(a) for r in self._active)}
            self._changed.notify_all()

    # ---------------------------------------------------------------- weights and control

    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]], body: dict[str, Any]) -> dict[str, Any]:
        self._require_memory("weight update", "weights")
        if body.get("abort_all_requests"):
            self.abort({"abort_all": True})
        with self.engine_lock:
            self.engine.update_weights(named_tensors)
            if self.device.type == "cuda":  # the reply frees the sender's buffers for reuse: the copies out of
                torch.cuda.synchronize(self.device)  # them (queued on this GPU) must have finished
            self.stale_weights.difference_update(name for name, _ in named_tensors)
            self.loads_without_kv_cache += "kv_cache" in self.released
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
        return {"success": True, "message": "Succeeded to update model weights."}

    def update_weights_from_disk(self, body: dict[str, Any]) -> dict[str, Any]:
        """Load every *.safetensors file under model_path (HF names); like SGLang, the model config stays."""
        path = body.get("model_path")
        if not path:
            raise RequestError("/update_weights_from_disk: model_path is required")
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise RequestError(f"/update_weights_from_disk: no *.safetensors files in {path}")
        named = [item for file in files for item in load_file(file).items()]
        reply = self.update_weights(named, body)
        return {**reply, "num_paused_requests": 0}

    def update_weight_version(self, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("new_version") is None:
            raise RequestError("/update_weight_version: new_version is required")
        if body.get("abort_all_requests"):
            self.abort({"abort_all": True})
        self.weight_version = str(body["new_version"])
        return {"success": True, "message": f"Weight version updated to {self.weight_version}."}

    # ---------------------------------------------------------------- LoRA adapters

    def load_lora_adapter(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /load_lora_adapter_from_tensors {lora_name, config_dict, serialized_tensors, load_format}: the adapter
        beside the base (`LocalEngine.load_lora_adapter`)."""
        route = "/load_lora_adapter_from_tensors"
        try:
            name, config, named = proto.lora_adapter_from_request(body, allow_cuda=self.device.type == "cuda")
        except tensor_serialization.PayloadError as error:
            raise RequestError(f"{route}: bad request: {error}") from error
        return self._add_adapter(route, name, lambda: self.engine.load_lora_adapter(name, config, named), AdapterError)

    def load_lora_adapter_from_path(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /load_lora_adapter {lora_name, lora_path, pinned}: the adapter beside the base from the PEFT directory
        at lora_path (`LocalEngine.load_lora_adapter_from_path`; pinned changes nothing here)."""
        route = "/load_lora_adapter"
        try:
            name, path = proto.lora_adapter_path_from_request(body)
        except tensor_serialization.PayloadError as error:
            raise RequestError(f"{route}: bad request: {error}") from error
        # OSError: no such directory or files; ValueError: an adapter the model cannot take
        return self._add_adapter(route, name, lambda: self.engine.load_lora_adapter_from_path(name, path),
                                 (OSError, ValueError))

    def _add_adapter(self, route: str, name: str, load: Callable[[], None],
                     errors: type[Exception] | tuple[type[Exception], ...]) -> dict[str, Any]:
        """Run `load` (which adds adapter `name` to the engine) under the engine lock; `route`'s reply. As SGLang, a
        name already loaded is refused (unload it first); `errors`, what `load` raises for an adapter it cannot
        take, become the route's `RequestError`."""
        with self.engine_lock:
            if name in self.engine.adapters.loaded:
                raise RequestError(f"{route}: adapter {name!r} is already loaded; POST /unload_lora_adapter first")
            try:
                load()
            except errors as error:
                raise RequestError(f"{route}: {error}") from error
            return proto.lora_update_reply(self.engine.adapters.loaded)

    def unload_lora_adapter(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /unload_lora_adapter {lora_name}."""
        with self.engine_lock:
            try:
                self.engine.unload_lora_adapter(str(body.get("lora_name")))
            except AdapterError as error:
                raise RequestError(f"/unload_lora_adapter: {error}") from error
            return proto.lora_update_reply(self.engine.adapters.loaded)

    # ---------------------------------------------------------------- weight-update groups

    def init_weights_update_group(self, body: dict[str, Any]) -> dict[str, Any]:
        """Join the trainer's group as rank rank_offset (this server has one TP rank); blocks until all joined."""
        spec = proto.WeightGroupSpec.from_body(body)
        if spec.backend == "nccl" and self.device.type != "cuda":
            raise RequestError("/init_weights_update_group: backend 'nccl' needs a server on a GPU (--device cuda); "
                               "this one runs on the CPU and joins gloo groups")
        if spec.group_name in self._groups:
            raise RequestError(f"/init_weights_update_group: group {spec.group_name!r} exists; destroy it first")
        try:
            self._groups[spec.group_name] = weight_group.join_as_server(spec, tp_rank=0, timeout=WEIGHT_GROUP_TIMEOUT)
        except (weight_group.WeightGroupError, RuntimeError) as error:
            raise RequestError(f"/init_weights_update_group: {error}") from error
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def update_weights_from_distributed(self, body: dict[str, Any]) -> dict[str, Any]:
        """Receive the broadcasts named in the body from rank 0, then load them like any update."""
        update = proto.DistributedUpdate.from_body(body)
        group = self._groups.get(update.group_name)
        if group is None:
            raise RequestError(f"/update_weights_from_distributed: no weight update group {update.group_name!r} "
                               f"(groups: {sorted(self._groups)}); call /init_weights_update_group first")
        try:
            named = weight_group.receive_on_server(group, update, self.device)
        except RuntimeError as error:
            raise RequestError(
                f"/update_weights_from_distributed: broadcast in {update.group_name!r} failed: {error}"
            ) from error
        return self.update_weights(named, body)

    def destroy_weights_update_group(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("group_name", "weight_update_group")
        if self._groups.pop(name, None) is None:
            raise RequestError(f"/destroy_weights_update_group: no weight update group {name!r} (groups: "
                               f"{sorted(self._groups)})")
        return {"success": True, "message": f"Succeeded to destroy custom process group {name}."}

    def weights_by_name(self, body: dict[str, Any]) -> list:
        """The first `truncate_size` rows of a parameter as float32 lists (SGLang /get_weights_by_name)."""
        self._require_memory("/get_weights_by_name", "weights")
        params = self.engine.named_parameters_hf()
        name = body.get("name")
        if name not in params:
            raise RequestError(f"/get_weights_by_name: no parameter {name!r}")
        return params[name][: int(body.get("truncate_size", 100))].float().tolist()

    # ---------------------------------------------------------------- memory hand-off

    def release_memory(self, body: dict[str, Any]) -> None:
        """POST /release_memory_occupation: the tags' memory is gone until resumed, and the server refuses
        what SGLang could not do without it (generation, weight loading).

        The weights' storages are freed in place. As SGLang's memory saver, a release of the weights loses
        their values unless the server keeps a CPU backup (--enable-weights-cpu-backup): SGLang would then
        sample from whatever the resumed memory holds; this server refuses to generate until every weight
        has been loaded again. The KV cache lives inside each generation here: its release returns the
        allocator's cached blocks on a GPU. A tag released twice is refused, as the memory saver refuses
        to pause what it paused."""
        tags = self._memory_tags(body)
        self.require_idle("/release_memory_occupation", "release needs an idle server")
        if tags & self.released:
            raise RequestError(f"/release_memory_occupation: {sorted(tags & self.released)} already released")
        with self.engine_lock:
            if "weights" in tags:
                self._weights.park(keep_values=self.weights_cpu_backup)
                self.engine.release_weight_layouts()
                if not self.weights_cpu_backup:
                    self.stale_weights = set(self.engine.named_parameters_hf())
            if self.device.type == "cuda":
                with torch.cuda.device(self.device):
                    torch.cuda.empty_cache()
        self.released |= tags
        self.memory_releases += 1

    def resume_memory(self, body: dict[str, Any]) -> None:
        """POST /resume_memory_occupation: only released tags (SGLang fails to resume what it did not release)."""
        tags = self._memory_tags(body)
        if tags - self.released:
            raise RequestError(f"/resume_memory_occupation: {sorted(tags - self.released)} not released")
        if "weights" in tags:
            with self.engine_lock:
                self._weights.restore()
        self.released -= tags

    @staticmethod
    def _memory_tags(body: dict[str, Any]) -> set[str]:
        tags = (body or {}).get("tags")
        try:
            proto.memory_occupation_request(tags)
        except ValueError as error:
            raise RequestError(str(error)) from error
        return set(proto.MEMORY_TAGS if tags is None else tags)

    def _require_memory(self, what: str, *tags: str) -> None:
        missing = sorted(self.released.intersection(tags))
        if missing:
            raise RequestError(f"{what}: memory {missing} is released; POST /resume_memory_occupation first")

    def _require_fresh_weights(self, what: str) -> None:
        if self.stale_weights:
            raise RequestError(
                f"{what}: {len(self.stale_weights)} weights (e.g. {min(self.stale_weights)}) lost their values to a "
                f"memory release without --enable-weights-cpu-backup and were not loaded again since"
            )

    def require_idle(self, path: str, message: str) -> None:
        in_flight = self.in_flight()
        if in_flight:
            raise RequestError(f"{path}: {message} ({in_flight} requests in flight)")

    def health_generate(self) -> None:
        """200 if the engine produced output: a running request counts, else a 1-token generation."""
        if self.in_flight() or self.released or self.stale_weights:  # alive, but cannot generate
            return
        with self.engine_lock:
            self.engine.generate([[self.eos_token_id or 0]], SamplingParams(temperature=0.0, max_new_tokens=1))

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": self.weight_version,
            "architectures": list(self.engine.model.config.architectures or []),
            "model_type": self.engine.model.config.model_type,
        }

    def server_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path, "host": self.host, "port": self.port, "tp_size": 1, "dp_size": 1,
            "random_seed": self.random_seed, "skip_tokenizer_init": True, "enable_memory_saver": True,
            "enable_weights_cpu_backup": self.weights_cpu_backup, "stale_weight_tensors": len(self.stale_weights),
            "weight_loads_without_kv_cache": self.loads_without_kv_cache,
            "released_memory_tags": sorted(self.released), "memory_releases": self.memory_releases,
            "device": str(self.device), "weight_bytes_resident": self._weights.resident_bytes(),
            "weight_version": self.weight_version, "version": SERVER_VERSION,
        }

    def loads(self) -> dict[str, Any]:
        """GET /v1/loads (field names inferred: running and waiting counts per DP rank)."""
        with self._counts:
            return {"dp_rank_count": 1, "loads": [{"dp_rank": 0, "num_running_reqs": self.running,
                                                    "num_waiting_reqs": self.waiting}]}
