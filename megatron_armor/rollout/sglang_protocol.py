"""SGLang's HTTP schema as pure functions: request bodies out, typed results in.

Shared by the client (`sglang_engine`) and the CPU stand-in server (`local_server`), so both speak
exactly one dialect. Field names follow SGLang 0.5.15 (`srt/managers/io_struct.py`); see
/work/shared/spec/sglang.md for the protocol notes.

Tensor payloads (`serialized_named_tensors`): SGLang sends base64 of ForkingPickler bytes, which
carry CUDA-IPC or shared-memory *handles* (valid only for a co-located process while the sender
keeps the storage alive) and need an allowlisting unpickler on the receiving side. Our CPU codec,
`encode_tensor_payload`, instead writes the payload *by value* with `torch.save` and reads it with
`torch.load(weights_only=True)`, torch's own allowlisting unpickler (tensors, str, numbers, lists,
tuples, dicts only), so a payload can cross processes or hosts and a hostile body cannot run code.
Flattened-bucket metadata therefore travels as plain dicts, not pickled dataclasses. A real SGLang
server cannot read this codec: feeding one needs SGLang's own `MultiprocessingSerializer` and
`FlattenedTensorBucket` on the co-located GPU host.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from megatron_armor.rollout.base import Generation, SamplingParams

LoadFormat = Literal["flattened_bucket"] | None
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


def generate_request(
    prompts: Sequence[Sequence[int]], sampling: SamplingParams, *, indices: Sequence[int] | None = None,
    rid: str | None = None,
) -> dict[str, Any]:
    """A batched /generate body: one item per prompt, output logprobs only.

    `indices` are the prompts' positions in the whole `generate` call (default 0..len-1). With
    `sampling.seed` set, prompt i gets `sampling_seed = seed + i`: samples are reproducible however
    prompts are split into requests or retried on other servers, and repeated prompts still draw
    different samples. `rid` names the request for /abort_request; item j gets `f"{rid}-{j}"`.
    """
    indices = range(len(prompts)) if indices is None else indices
    if len(indices) != len(prompts):
        raise ValueError(f"got {len(indices)} indices for {len(prompts)} prompts")
    seeds = [None if sampling.seed is None else sampling.seed + i for i in indices]
    body: dict[str, Any] = {
        "input_ids": [list(p) for p in prompts],
        "sampling_params": [sampling_params_body(sampling, s) for s in seeds],
        "return_logprob": True, "logprob_start_len": -1, "return_text_in_logprobs": False, "stream": False,
    }
    if rid is not None:
        body["rid"] = [f"{rid}-{j}" for j in range(len(prompts))]
    return body


@dataclass(frozen=True)
class Aborted:
    """An item SGLang aborted (finish_reason type "abort"); the client retries its prompt."""

    message: str


def finish_reason_body(finish: FinishType, *, stop_token: int | None = None, length: int = 0, message: str = "") -> dict:
    """SGLang's meta_info.finish_reason dict (srt/managers/schedule_batch.py)."""
    if finish == "stop":
        return {"type": "stop", "matched": stop_token}
    if finish == "length":
        return {"type": "length", "length": length}
    return {"type": "abort", "message": message, "status_code": 400, "err_type": None}


def generate_item_body(
    rid: str, prompt_len: int, output_ids: list[int], logprobs: list[float], finish_reason: dict, weight_version: str
) -> dict[str, Any]:
    """One /generate output item (no `text`: the server runs with --skip-tokenizer-init semantics).

    output_token_logprobs: [R] triples [logprob, token_id, null] for every generated token.
    """
    return {
        "output_ids": output_ids,
        "meta_info": {
            "id": rid, "finish_reason": finish_reason, "prompt_tokens": prompt_len,
            "completion_tokens": len(logprobs), "cached_tokens": 0, "weight_version": weight_version,
            "num_retractions": 0, "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, output_ids)],
        },
    }


def parse_generate_item(prompt: Sequence[int], item: dict[str, Any]) -> Generation | Aborted:
    """One /generate output item -> a Generation (or Aborted).

    Tokens and logprobs come from `meta_info.output_token_logprobs` ([logprob, token_id, text|null]
    triples), as slime reads them; `output_ids` may be stop-trimmed, the triples never are.
    """
    meta = item["meta_info"]
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type")
    if kind == "abort":
        return Aborted(message=str(finish.get("message", "")))
    if kind not in ("stop", "length"):
        raise ValueError(f"SGLang finish_reason must have type stop, length or abort, got {finish!r}")
    triples = meta.get("output_token_logprobs")
    if triples is None:
        raise ValueError("SGLang /generate item has no meta_info.output_token_logprobs; send return_logprob=true")
    return Generation(
        prompt_ids=list(prompt), response_ids=[int(t[1]) for t in triples],
        logprobs=[float(t[0]) for t in triples], finish_reason=kind,
    )


def parse_generate_response(prompts: Sequence[Sequence[int]], body: Any) -> list[Generation | Aborted]:
    """A batched /generate response (a list, one item per prompt, in order)."""
    if not isinstance(body, list) or len(body) != len(prompts):
        got = f"a list of {len(body)}" if isinstance(body, list) else type(body).__name__
        raise ValueError(f"SGLang /generate returned {got} items for a batch of {len(prompts)} prompts")
    return [parse_generate_item(p, item) for p, item in zip(prompts, body)]


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


# ---------------------------------------------------------------- weight payloads


@dataclass(frozen=True)
class FlattenedTensorMetadata:
    """Where one tensor sits in a flattened bucket (SGLang srt/weight_sync/tensor_bucket.py).

    start_idx/end_idx/numel count bytes of the bucket's 1-D uint8 tensor; dtype is a torch dtype
    name without the "torch." prefix (e.g. "bfloat16").
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    start_idx: int
    end_idx: int
    numel: int


def flatten_bucket(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """SGLang's "flattened_bucket" payload: {flattened_tensor: [N bytes] uint8, metadata: [dict]}."""
    chunks, metadata, start = [], [], 0
    for name, tensor in named_tensors:
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        metadata.append(asdict(FlattenedTensorMetadata(
            name=name, shape=tuple(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch."),
            start_idx=start, end_idx=start + data.numel(), numel=data.numel(),
        )))
        chunks.append(data)
        start += data.numel()
    flat = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    return {"flattened_tensor": flat, "metadata": metadata}


def unflatten_bucket(payload: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Inverse of `flatten_bucket` (copies, so tensors do not alias the bucket)."""
    flat: torch.Tensor = payload["flattened_tensor"]
    out = []
    for raw in payload["metadata"]:
        meta = FlattenedTensorMetadata(**{**raw, "shape": tuple(raw["shape"])})
        dtype = getattr(torch, meta.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"flattened_bucket: tensor {meta.name} has unknown dtype {meta.dtype!r}")
        data = flat[meta.start_idx : meta.end_idx]
        out.append((meta.name, data.clone().view(dtype).reshape(meta.shape)))
    return out


def encode_tensor_payload(obj: Any) -> str:
    """base64 text of one TP rank's payload (a named-tensor list or a flattened bucket); see module doc."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_tensor_payload(text: str) -> Any:
    """Inverse of `encode_tensor_payload`; refuses anything but tensors and plain containers."""
    return torch.load(io.BytesIO(base64.b64decode(text, validate=True)), weights_only=True)


def update_weights_from_tensor_request(
    named_tensors: Sequence[tuple[str, torch.Tensor]], *, tp_size: int = 1, load_format: LoadFormat = "flattened_bucket",
    flush_cache: bool = True, weight_version: str | None = None,
) -> dict[str, Any]:
    """An /update_weights_from_tensor body carrying full HF tensors to each of `tp_size` ranks.

    Every rank gets the same payload (SGLang's load_weights TP-slices HF tensors itself).
    """
    tensors = [(name, t.detach().cpu()) for name, t in named_tensors]
    payload = flatten_bucket(tensors) if load_format == "flattened_bucket" else tensors
    encoded = encode_tensor_payload(payload)
    body: dict[str, Any] = {
        "serialized_named_tensors": [encoded] * tp_size, "load_format": load_format, "flush_cache": flush_cache,
    }
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body


def named_tensors_from_request(body: dict[str, Any], tp_rank: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Decode rank `tp_rank`'s entry of an /update_weights_from_tensor body."""
    entries = body.get("serialized_named_tensors")
    if not isinstance(entries, list) or len(entries) <= tp_rank:
        raise ValueError(f"serialized_named_tensors must be a list with an entry for TP rank {tp_rank}")
    payload = decode_tensor_payload(entries[tp_rank])
    load_format = body.get("load_format")
    if load_format == "flattened_bucket":
        return unflatten_bucket(payload)
    if load_format is not None:
        raise ValueError(f"load_format {load_format!r} is not supported; use null or 'flattened_bucket'")
    return [(str(name), tensor) for name, tensor in payload]


def bucket_named_tensors(
    named_tensors: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """Split into consecutive buckets of at most `bucket_bytes` (a larger tensor gets its own bucket)."""
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    size = math.inf
    for name, tensor in named_tensors:
        if size + tensor.nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, tensor))
        size += tensor.nbytes
    return buckets


# ---------------------------------------------------------------- control endpoints


def update_weights_from_disk_request(model_path: str, *, flush_cache: bool = True) -> dict[str, Any]:
    return {"model_path": model_path, "flush_cache": flush_cache}


def abort_request(rid: str = "", *, abort_all: bool = False) -> dict[str, Any]:
    return {"rid": rid, "abort_all": abort_all}


def memory_occupation_request(tags: Sequence[str] | None = None) -> dict[str, Any]:
    """Body for /release_memory_occupation and /resume_memory_occupation; None means all tags."""
    allowed = {"weights", "kv_cache", "cuda_graph"}
    if tags is not None and not set(tags) <= allowed:
        raise ValueError(f"memory tags must be a subset of {sorted(allowed)}, got {list(tags)}")
    return {"tags": None if tags is None else list(tags)}
