"""SGLang's HTTP schema as pure functions: request bodies out, typed results in.

Shared by the client (`sglang_engine`) and the CPU stand-in server (`local_server`), so both speak
exactly one dialect. Field names follow SGLang 0.5.15 (`srt/managers/io_struct.py`); see
/work/shared/spec/sglang.md for the protocol notes. Tensor payloads of /update_weights_from_tensor
are SGLang's own (ForkingPickler, allowlisted unpickling): `tensor_serialization`.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
import torch

from megatron_armor.rollout import tensor_serialization
from megatron_armor.rollout.base import Generation, SamplingParams

LoadFormat = Literal["flattened_bucket"] | None
PauseMode = Literal["abort", "retract", "in_place"]
FinishType = Literal["stop", "length", "abort"]


# ---------------------------------------------------------------- /generate


def sampling_params_body(sampling: SamplingParams, seed: int | None) -> dict[str, Any]:
    """SGLang `sampling_params` for one prompt.

    `ignore_eos=True`: like `LocalEngine`, stop only at `stop_token_ids` (callers list EOS there).
    `no_stop_trim=True`: keep the stop token in `output_ids`, aligned with the logprobs (as slime).
    """
    body: dict[str, Any] = {
        "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": -1,
        "max_new_tokens": sampling.max_new_tokens, "stop_token_ids": list(sampling.stop_token_ids),
        "ignore_eos": True, "no_stop_trim": True, "skip_special_tokens": False,
    }
    if seed is not None:
        body["sampling_seed"] = seed
    return body


def prompt_seed(sampling: SamplingParams, index: int) -> int | None:
    """The `sampling_seed` of prompt `index` of a `generate` call: `sampling.seeds[index]`, else `sampling.seed +
    index`, else none (the server's own generator)."""
    if sampling.seeds is not None:
        return sampling.seeds[index]
    return None if sampling.seed is None else sampling.seed + index


def generate_request(
    prompts: Sequence[Sequence[int]], sampling: SamplingParams, *, indices: Sequence[int] | None = None,
    rid: str | None = None, return_routed_experts: bool = False, lora: str | None = None,
) -> dict[str, Any]:
    """A batched /generate body: one item per prompt, output logprobs only (and with `return_routed_experts` each
    item's `meta_info.routed_experts`, `encode_routed_experts`); with `lora` every item samples with that loaded
    LoRA adapter (SGLang's `lora_path`, one per item: the adapter's name), else with the base.

    `indices` are the prompts' positions in the whole `generate` call (default 0..len-1). With
    `sampling.seed` set, prompt i gets `sampling_seed = seed + i` (with `sampling.seeds`, `seeds[i]`): samples are
    reproducible however prompts are split into requests or retried on other servers, and repeated prompts still
    draw different samples. `rid` names the request for /abort_request; item j gets `f"{rid}-{j}"`.
    """
    indices = range(len(prompts)) if indices is None else indices
    if len(indices) != len(prompts):
        raise ValueError(f"got {len(indices)} indices for {len(prompts)} prompts")
    seeds = [prompt_seed(sampling, i) for i in indices]
    body: dict[str, Any] = {
        "input_ids": [list(p) for p in prompts],
        "sampling_params": [sampling_params_body(sampling, s) for s in seeds],
        "return_logprob": True, "logprob_start_len": -1, "return_text_in_logprobs": False, "stream": False,
    }
    if return_routed_experts:
        body["return_routed_experts"] = True
    if rid is not None:
        body["rid"] = [f"{rid}-{j}" for j in range(len(prompts))]
    if lora is not None:
        body["lora_path"] = [lora] * len(prompts)
    return body


def single_generate_request(
    prompt: Sequence[int], sampling: SamplingParams, *, index: int, rid: str, return_routed_experts: bool = False,
    lora: str | None = None,
) -> dict[str, Any]:
    """`generate_request` for one prompt in SGLang's unbatched form: `input_ids` a flat list, one
    `sampling_params` dict, `rid` a string (and `lora_path` one name); the reply is one item, not a list. SGLang's
    router (sglang-router 0.3.2) accepts only this form: it rejects per-item sampling_params and rid lists.
    """
    body = generate_request([prompt], sampling, indices=[index], return_routed_experts=return_routed_experts,
                            lora=lora)
    single = {**body, "input_ids": body["input_ids"][0], "sampling_params": body["sampling_params"][0], "rid": rid}
    if lora is not None:
        single["lora_path"] = lora
    return single


@dataclass(frozen=True)
class Aborted:
    """An item SGLang aborted (finish_reason type "abort"): the client retries its prompt, or, while it interrupts
    its generations (`SGLangEngine.interrupt`), keeps `partial`: the tokens and logprobs generated before the abort
    (SGLang returns them with the abort), finish_reason "abort"."""

    message: str
    partial: Generation


def finish_reason_body(finish: FinishType, *, stop_token: int | None = None, length: int = 0, message: str = "") -> dict:
    """SGLang's meta_info.finish_reason dict (srt/managers/schedule_batch.py)."""
    if finish == "stop":
        return {"type": "stop", "matched": stop_token}
    if finish == "length":
        return {"type": "length", "length": length}
    return {"type": "abort", "message": message, "status_code": 400, "err_type": None}


def generate_item_body(
    rid: str, prompt_len: int, output_ids: list[int], logprobs: list[float], finish_reason: dict, weight_version: str,
    routed_experts: torch.Tensor | None = None,
) -> dict[str, Any]:
    """One /generate output item (no `text`: the server runs with --skip-tokenizer-init semantics).

    output_token_logprobs: [R] triples [logprob, token_id, null] for every generated token;
    routed_experts (when given): `encode_routed_experts` of [P + R - 1, L, k].
    """
    meta = {
        "id": rid, "finish_reason": finish_reason, "prompt_tokens": prompt_len,
        "completion_tokens": len(logprobs), "cached_tokens": 0, "weight_version": weight_version,
        "num_retractions": 0, "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, output_ids)],
    }
    if routed_experts is not None:
        meta["routed_experts"] = encode_routed_experts(routed_experts)
    return {"output_ids": output_ids, "meta_info": meta}


# SGLang's routed experts (srt/layers/moe/routed_experts_capturer.py, read from sgl-project/sglang's newest stored
# snapshot): with --enable-return-routed-experts and a request's `return_routed_experts: true`, each item's
# meta_info["routed_experts"] is the base64 of an int32 array [prompt_tokens + completion_tokens - 1,
# num_hidden_layers, num_experts_per_tok] (`get_routed_experts` slices a request's KV slots [: seqlen - 1]: every
# token the model was fed, the last sampled one never is; layers are the decoder's layer ids, a layer without a
# router keeps its buffer's zeros). The shape is not sent: the client reshapes (-1, L, k) (slime does the same).
def encode_routed_experts(routes: torch.Tensor) -> str:
    """routes [N, L, k] -> base64 of its little-endian int32 bytes (SGLang's meta_info.routed_experts)."""
    return base64.b64encode(routes.to(torch.int32).numpy().astype("<i4").tobytes()).decode("ascii")


def decode_routed_experts(text: str, layers: int, top_k: int) -> torch.Tensor:
    """The inverse of `encode_routed_experts`: [N, layers, top_k] int32."""
    flat = np.frombuffer(base64.b64decode(text), dtype="<i4").astype(np.int32)
    return torch.from_numpy(flat.copy()).view(-1, layers, top_k)


def parse_generate_item(
    prompt: Sequence[int], item: dict[str, Any], route_shape: tuple[int, int] | None = None,
) -> Generation | Aborted:
    """One /generate output item -> a Generation (or Aborted).

    Tokens and logprobs come from `meta_info.output_token_logprobs` ([logprob, token_id, text|null]
    triples), as slime reads them; `output_ids` may be stop-trimmed, the triples never are. With `route_shape`
    (L, k) the item must carry `meta_info.routed_experts`.
    """
    meta = item["meta_info"]
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type")
    if kind not in ("stop", "length", "abort"):
        raise ValueError(f"SGLang finish_reason must have type stop, length or abort, got {finish!r}")
    triples = meta.get("output_token_logprobs")
    if triples is None and kind != "abort":  # an item aborted before its first token may come back without them
        raise ValueError("SGLang /generate item has no meta_info.output_token_logprobs; send return_logprob=true")
    ids, logprobs = [int(t[1]) for t in triples or ()], [float(t[0]) for t in triples or ()]
    if kind == "abort":
        return Aborted(message=str(finish.get("message", "")),
                       partial=Generation(prompt_ids=list(prompt), response_ids=ids, logprobs=logprobs,
                                          finish_reason="abort"))
    routes = None
    if route_shape is not None:
        if meta.get("routed_experts") is None:
            raise ValueError("SGLang /generate item has no meta_info.routed_experts; send return_routed_experts=true "
                             "to a server started with --enable-return-routed-experts")
        routes = decode_routed_experts(meta["routed_experts"], *route_shape)
    return Generation(prompt_ids=list(prompt), response_ids=ids, logprobs=logprobs, finish_reason=kind,
                      routed_experts=routes)


def parse_generate_response(
    prompts: Sequence[Sequence[int]], body: Any, route_shape: tuple[int, int] | None = None,
) -> list[Generation | Aborted]:
    """A batched /generate response (a list, one item per prompt, in order); `route_shape` as `parse_generate_item`'s."""
    if not isinstance(body, list) or len(body) != len(prompts):
        got = f"a list of {len(body)}" if isinstance(body, list) else type(body).__name__
        raise ValueError(f"SGLang /generate returned {got} items for a batch of {len(prompts)} prompts")
    return [parse_generate_item(p, item, route_shape) for p, item in zip(prompts, body)]


@dataclass(frozen=True)
class RequestSampling:
    """One /generate item's `sampling_params` as the server honours them."""

    sampling: SamplingParams
    n: int = 1  # samples of this prompt, returned next to each other
    ignore_eos: bool = False  # False: the model's EOS also stops generation
    no_stop_trim: bool = False  # False: the matched stop token is cut from output_ids (not from the logprobs)


def sampling_from_body(params: dict[str, Any]) -> RequestSampling:
    """Parse SGLang `sampling_params`; ValueError for options this server cannot honour.

    temperature below 1e-6 means greedy (SGLang sets top_k=1 there).
    """
    defaults_only = {"top_k": (-1, None), "min_p": (0, None), "frequency_penalty": (0, None),
                     "presence_penalty": (0, None), "stop": (None, "", []), "regex": (None,), "json_schema": (None,)}
    unsupported = {k: v for k, v in params.items() if k in defaults_only and v not in defaults_only[k]}
    if unsupported:
        raise ValueError(f"sampling_params not supported by this server: {unsupported}")
    temperature = float(params.get("temperature", 1.0))
    sampling = SamplingParams(
        temperature=0.0 if temperature < 1e-6 else temperature, top_p=float(params.get("top_p", 1.0)),
        max_new_tokens=int(params.get("max_new_tokens", 128)),
        stop_token_ids=tuple(int(t) for t in params.get("stop_token_ids") or ()), seed=params.get("sampling_seed"),
    )
    return RequestSampling(sampling, n=int(params.get("n", 1)), ignore_eos=bool(params.get("ignore_eos", False)),
                           no_stop_trim=bool(params.get("no_stop_trim", False)))


# ---------------------------------------------------------------- /update_weights_from_tensor


def payload_align(load_format: LoadFormat) -> int:
    """SGLang's flattened_bucket has no padding; load_format null sends views, so every tensor starts at a
    multiple of the largest element size (16 bytes) and none needs a copy of its own."""
    return 1 if load_format == "flattened_bucket" else 16


def staged_tensors(
    named_tensors: Sequence[tuple[str, torch.Tensor]], load_format: LoadFormat
) -> list[tuple[str, torch.Tensor]]:
    """The tensors `tensor_payload` copies into its buffer: all of a flattened bucket; with load_format null,
    those that cannot travel as a handle to their own storage (`tensor_serialization.maps_without_copy`)."""
    if load_format == "flattened_bucket":
        return list(named_tensors)
    return [(name, t) for name, t in named_tensors if not tensor_serialization.maps_without_copy(t)]


def payload_bytes(named_tensors: Sequence[tuple[str, torch.Tensor]], load_format: LoadFormat) -> int:
    """Bytes `tensor_payload` packs `named_tensors` into (the staging buffer it needs; 0 if none)."""
    layout = tensor_serialization.flattened_layout(staged_tensors(named_tensors, load_format), payload_align(load_format))
    return layout[-1].end_idx if layout else 0


def tensor_payload(
    named_tensors: Sequence[tuple[str, torch.Tensor]], load_format: LoadFormat, staging: torch.Tensor | None = None
) -> Any:
    """One TP rank's /update_weights_from_tensor payload. `staged_tensors` are packed into one buffer:
    `staging` (a `tensor_serialization.shared_buffer` or CUDA buffer of >= `payload_bytes`) if given, else a
    fresh one; never pickled as they are, since pickling would move a CPU tensor's storage into shared memory.

    "flattened_bucket": SGLang's {flattened_tensor, metadata} dict; null: [(name, tensor)] in order, each a
    view into the buffer or, if it maps without a copy (a CUDA tensor, a CPU tensor in shared memory), the
    caller's tensor itself: the server copies from the trainer's own storage, with no staging copy.
    Keep the payload alive, and `staging` and those tensors unchanged, until every server has answered:
    the request carries handles to them, not their bytes."""
    staged = staged_tensors(named_tensors, load_format)
    bucket = tensor_serialization.flatten_bucket(staged, out=staging, align=payload_align(load_format))
    if load_format == "flattened_bucket":
        return bucket
    views = iter(tensor_serialization.unflatten_bucket(bucket["flattened_tensor"], bucket["metadata"]))
    return [next(views) if not tensor_serialization.maps_without_copy(t) else (name, t.detach())
            for name, t in named_tensors]


def update_weights_from_tensor_request(
    payload: Any, *, tp_size: int = 1, load_format: LoadFormat = "flattened_bucket", flush_cache: bool = True,
    weight_version: str | None = None,
) -> dict[str, Any]:
    """An /update_weights_from_tensor body giving each of `tp_size` ranks the full HF tensors of `payload`
    (from `tensor_payload`; SGLang's load_weights TP-slices them). Each rank gets its own serialization,
    since each one takes a shared-memory reference when it unpickles."""
    body = {
        "serialized_named_tensors": [tensor_serialization.serialize(payload) for _ in range(tp_size)],
        "load_format": load_format, "flush_cache": flush_cache,
    }
    return _with_version(body, weight_version)


def named_tensors_from_request(
    body: dict[str, Any], tp_rank: int = 0, *, allow_cuda: bool = False
) -> list[tuple[str, torch.Tensor]]:
    """Decode rank `tp_rank`'s entry of an /update_weights_from_tensor body (PayloadError if it is bad;
    CUDA-IPC handles only if `allow_cuda`)."""
    entries = body.get("serialized_named_tensors")
    if not isinstance(entries, list) or len(entries) <= tp_rank or not isinstance(entries[tp_rank], str):
        raise tensor_serialization.PayloadError(
            f"serialized_named_tensors must be a list of base64 strings with an entry for TP rank {tp_rank}"
        )
    payload = tensor_serialization.deserialize(entries[tp_rank], allow_cuda=allow_cuda)
    return tensor_serialization.named_tensors_from_payload(payload, body.get("load_format"))


def bucket_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, align: int = 1
) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """Consecutive buckets of at most `bucket_bytes` as (bucket, is_last), drawn lazily from `named_tensors`.

    A bucket's size is its `flattened_layout` end with `align` (`payload_align`); a larger tensor gets its own
    bucket. A bucket is yielded once the next tensor is drawn (or the input ends), so `is_last` is known; the
    generator holds at most the bucket being filled and that one tensor.
    """
    bucket: list[tuple[str, torch.Tensor]] = []
    end = 0  # bytes of `bucket`'s layout
    for name, tensor in named_tensors:
        start = -(-end // align) * align
        if bucket and start + tensor.nbytes > bucket_bytes:
            yield bucket, False
            bucket, start = [], 0
        bucket.append((name, tensor))
        end = start + tensor.nbytes
    if bucket:
        yield bucket, True


# ---------------------------------------------------------------- LoRA adapters


def load_lora_adapter_from_tensors_request(name: str, config: dict[str, Any], payload: Any) -> dict[str, Any]:
    """A /load_lora_adapter_from_tensors body (SGLang's LoadLoRAAdapterFromTensorsReqInput): adapter `name` from
    `payload` (`tensor_payload(<PEFT-named tensors>, None)`) as one ForkingPickler text (`serialized_tensors`, as
    SGLang's MultiprocessingSerializer makes it: shared-memory or CUDA-IPC handles, so the server must run on this
    host) and PEFT's config dict. Build one body per receiving server (each unpickling takes a reference), and keep
    the payload alive until it has answered."""
    return {"lora_name": name, "config_dict": config, "load_format": None,
            "serialized_tensors": tensor_serialization.serialize(payload)}


def lora_adapter_from_request(
    body: dict[str, Any], *, allow_cuda: bool = False
) -> tuple[str, dict[str, Any], list[tuple[str, torch.Tensor]]]:
    """(name, config dict, PEFT-named tensors) of a /load_lora_adapter_from_tensors body; PayloadError if it is
    bad (CUDA-IPC handles only if `allow_cuda`). The tensors are views into shared memory: copy them before dropping
    the body."""
    name, config, text = body.get("lora_name"), body.get("config_dict"), body.get("serialized_tensors")
    if not isinstance(name, str) or not name or not isinstance(config, dict) or not isinstance(text, str):
        raise tensor_serialization.PayloadError(
            "lora_name (a non-empty string), config_dict (an object) and serialized_tensors (base64 text) are required")
    payload = tensor_serialization.deserialize(text, allow_cuda=allow_cuda)
    return name, config, tensor_serialization.named_tensors_from_payload(payload, body.get("load_format"))


def load_lora_adapter_request(name: str, path: str) -> dict[str, Any]:
    """A /load_lora_adapter body (SGLang's LoadLoRAAdapterReqInput): adapter `name` from the PEFT directory at `path`
    on the server's filesystem, not pinned in memory."""
    return {"lora_name": name, "lora_path": path, "pinned": False}


def lora_adapter_path_from_request(body: dict[str, Any]) -> tuple[str, str]:
    """(name, path) of a /load_lora_adapter body; PayloadError if either is missing."""
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise tensor_serialization.PayloadError("lora_name and lora_path (non-empty strings) are required")
    return name, path


def unload_lora_adapter_request(name: str) -> dict[str, Any]:
    """An /unload_lora_adapter body (SGLang's UnloadLoRAAdapterReqInput)."""
    return {"lora_name": name}


def lora_update_reply(loaded: Iterable[str]) -> dict[str, Any]:
    """SGLang's LoRAUpdateOutput after a successful load or unload: the adapters now loaded (name -> its path;
    adapters loaded from tensors have the path "__tensor__")."""
    return {"success": True, "error_message": None, "loaded_adapters": {name: "__tensor__" for name in loaded}}


# ---------------------------------------------------------------- control endpoints


def update_weights_from_disk_request(
    model_path: str, *, flush_cache: bool = True, weight_version: str | None = None
) -> dict[str, Any]:
    return _with_version({"model_path": model_path, "flush_cache": flush_cache}, weight_version)


def _with_version(body: dict[str, Any], weight_version: str | None) -> dict[str, Any]:
    return body if weight_version is None else {**body, "weight_version": weight_version}


def abort_request(rid: str = "", *, abort_all: bool = False) -> dict[str, Any]:
    return {"rid": rid, "abort_all": abort_all}


MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def memory_occupation_request(tags: Sequence[str] | None = None) -> dict[str, Any]:
    """Body for /release_memory_occupation and /resume_memory_occupation; None means all `MEMORY_TAGS`."""
    if tags is not None and not set(tags) <= set(MEMORY_TAGS):
        raise ValueError(f"memory tags must be a subset of {list(MEMORY_TAGS)}, got {list(tags)}")
    return {"tags": None if tags is None else list(tags)}


# ---------------------------------------------------------------- distributed weight updates


@dataclass(frozen=True)
class WeightGroupSpec:
    """/init_weights_update_group: a process group of the trainer (rank 0, the broadcaster) and every
    server TP rank (rank `rank_offset + tp_rank`), met through a TCP store at master_address:master_port."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"

    def body(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> WeightGroupSpec:
        """Parse and check a request body; ValueError naming the bad field."""
        missing = [name for name in ("master_address", "master_port", "rank_offset", "world_size") if name not in body]
        if missing:
            raise ValueError(f"/init_weights_update_group: missing {missing}")
        spec = cls(str(body["master_address"]), int(body["master_port"]), int(body["rank_offset"]),
                   int(body["world_size"]), str(body.get("group_name", "weight_update_group")),
                   str(body.get("backend", "nccl")))
        if not 1 <= spec.rank_offset < spec.world_size:
            raise ValueError(f"/init_weights_update_group: rank_offset {spec.rank_offset} must be in [1, world_size "
                             f"{spec.world_size}) (rank 0 is the trainer)")
        return spec


@dataclass(frozen=True)
class DistributedUpdate:
    """/update_weights_from_distributed: tensors the trainer broadcasts from rank 0, in order.

    Without load_format, one broadcast per name; with "flattened_bucket", one [sum of bytes] uint8
    broadcast holding the tensors' bytes back to back (`tensor_serialization.flattened_layout`).
    """

    names: tuple[str, ...]
    dtypes: tuple[str, ...]  # torch dtype names without "torch.", e.g. "bfloat16"
    shapes: tuple[tuple[int, ...], ...]
    group_name: str = "weight_update_group"
    load_format: LoadFormat = None
    flush_cache: bool = True
    weight_version: str | None = None

    @classmethod
    def of(cls, named_tensors: Sequence[tuple[str, torch.Tensor]], **options: Any) -> DistributedUpdate:
        return cls(tuple(n for n, _ in named_tensors), tuple(str(t.dtype).removeprefix("torch.") for _, t in named_tensors),
                   tuple(tuple(t.shape) for _, t in named_tensors), **options)

    def body(self) -> dict[str, Any]:
        body = {"names": list(self.names), "dtypes": list(self.dtypes), "shapes": [list(s) for s in self.shapes],
                "group_name": self.group_name, "flush_cache": self.flush_cache, "load_format": self.load_format}
        return _with_version(body, self.weight_version)

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> DistributedUpdate:
        """Parse and check a request body; ValueError naming the bad field."""
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)) or not (
            len(names) == len(dtypes) == len(shapes)
        ):
            raise ValueError("/update_weights_from_distributed: names, dtypes and shapes must be lists of one length")
        for name, dtype in zip(names, dtypes):
            if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
                raise ValueError(f"/update_weights_from_distributed: {name} has unknown dtype {dtype!r}")
        load_format = body.get("load_format")
        if load_format not in (None, "flattened_bucket"):
            raise ValueError(f"/update_weights_from_distributed: load_format {load_format!r} is not supported; "
                             "use null or 'flattened_bucket'")
        version = body.get("weight_version")
        return cls(tuple(map(str, names)), tuple(map(str, dtypes)), tuple(tuple(int(d) for d in s) for s in shapes),
                   str(body.get("group_name", "weight_update_group")), load_format, bool(body.get("flush_cache", True)),
                   None if version is None else str(version))

    def empty_tensors(self, device: torch.device | str = "cpu") -> list[tuple[str, torch.Tensor]]:
        """Receive buffers: one uninitialised tensor per name on `device`."""
        return [(n, torch.empty(s, dtype=getattr(torch, d), device=device))
                for n, d, s in zip(self.names, self.dtypes, self.shapes)]


def destroy_weights_update_group_request(group_name: str) -> dict[str, Any]:
    return {"group_name": group_name}


# ---------------------------------------------------------------- pause and continue


def pause_generation_request(mode: PauseMode = "abort") -> dict[str, Any]:
    """abort: running and queued requests end with finish type "abort"; retract / in_place: they wait."""
    if mode not in ("abort", "retract", "in_place"):
        raise ValueError(f"pause_generation mode must be abort, retract or in_place, got {mode!r}")
    return {"mode": mode}


def continue_generation_request() -> dict[str, Any]:
    return {"torch_empty_cache": False}
