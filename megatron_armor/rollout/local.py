"""In-process rollout engine: an HF transformers model with batched, KV-cached sampling.

The CPU default behind `RolloutEngine`; the SGLang client implements the same interface for GPU
clusters. Prompts are left-padded into one batch (position ids restart at each row's first real
token) and decoded incrementally with a KV cache preallocated for the batch (`rollout/kv_cache.py`), on the
device the model lives on; on the CPU its larger linear layers (>= 2^17 weights) multiply float32 inputs by weights
laid out once for oneDNN (`rollout/prepacked_linear.py`).

`weight_precision` ("fp32" | "bf16" | "fp8", see `rollout/precision.py`) rounds the weights the
engine loads and receives, so its logprobs differ from the trainer's the way production engines do.
`record_routes` (MoE models) makes every `Generation` carry the experts its tokens were routed to
(`Generation.routed_experts`, SGLang's layout; `rollout/route_capture.py`).
LoRA adapters load beside the base weights by name (`load_lora_adapter`, from PEFT-named tensors:
`rollout/engine_lora.py`); a `generate` call names the adapter it samples with (`lora`), or none: the base.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.cache_utils import Cache

from megatron_armor.config import LocalEngineConfig
from megatron_armor.config.builders import builds
from megatron_armor.models.families import model_family
from megatron_armor.models.tensors import checkpoint_tensors
from megatron_armor.rollout.kv_cache import PreallocatedCache
from megatron_armor.rollout.base import Generation, RolloutEngine, SamplingParams
from megatron_armor.rollout.engine_lora import EngineAdapters
from megatron_armor.rollout.precision import ENGINE_PRECISIONS, EnginePrecision, quantize_weight
from megatron_armor.rollout.prepacked_linear import drop_layouts, prepack_linears
from megatron_armor.rollout.route_capture import RouteCapture
from megatron_armor.utils.peft_files import read_peft_adapter


def sample_next_tokens(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | Sequence[torch.Generator] | None,
    rows: torch.Tensor | None = None, batch_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row. logits: [A, V] -> (tokens [A] int64, logprobs [A] float32).

    logprobs are log_softmax(logits / T) in float32 of the drawn token before top-p filtering (SGLang
    semantics); T = 0 is greedy with the unscaled log_softmax. The draw inverts each row's CDF (float64
    cumulative sum of the kept probabilities) at one uniform u ~ U[0, 1) per row: the first token whose cumulative
    probability exceeds u times the row's total. The uniforms are drawn for the whole batch, [batch_size], and
    logits' row i takes u[rows[i]] (default: one per logits row), so a decode batch that dropped its finished rows
    draws what the full batch would have drawn for the rows it kept. `generator` a sequence (one per batch row,
    `SamplingParams.seeds`): batch row b's uniform is the next draw of `generator[b]` (a CPU generator), so a row's
    tokens depend on its own seed alone. One random number per row and a cumulative
    sum cost far less than `torch.multinomial`'s one exponential variate per vocabulary entry (the profile that showed
    it: docs/benchmarks.md, "Rollout engine").
    """
    if sampling.temperature == 0:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        tokens = logprobs.argmax(dim=-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    logprobs = torch.log_softmax(logits.float() / sampling.temperature, dim=-1)
    probs = logprobs.exp()
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the tokens ranked above it already reach top_p (the top token stays).
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= sampling.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    if isinstance(generator, Sequence):
        uniform = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generator]).to(probs.device)
    else:
        uniform = torch.rand(batch_size or probs.shape[0], generator=generator, dtype=torch.float64,
                             device=probs.device)
    if rows is not None:
        uniform = uniform.index_select(0, rows)
    cdf = probs.double().cumsum(dim=-1)  # [A, V]
    tokens = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).squeeze(-1)
    tokens = tokens.clamp_(max=probs.shape[-1] - 1)  # u * total rounding onto the last boundary
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


@dataclass
class _DecodeBatch:
    """The rows of one `generate` batch still being decoded (A of the batch's B), with their KV cache.

    A prompt that several rows share (RL samples n responses per prompt) is prefilled once: until `expand`, the
    cache, mask and positions hold the U distinct prompts and `prompt_of_row` [B] says which one each row reads;
    `expand` then copies each prompt's cache to its rows (the values a prefill of every row would give, up to the
    rounding of a matrix product with fewer rows: tests/rollout/test_engine_equivalence.py).
    Rows that stopped stay (their draws are ignored) until enough have stopped to make dropping them
    from the cache and the mask worth the copy (`COMPACT_FRACTION`); each row's logits are then bit-for-bit
    those of the whole batch (`MIN_ROWS`).
    """

    cache: Cache
    attention: torch.Tensor  # [A, capacity] int64 (before `expand`: [U, capacity]): 1 at real tokens; < length filled
    length: int
    positions: torch.Tensor  # [A, T] position ids of the next forward's inputs (before `expand`: [U, W])
    rows: torch.Tensor  # [A] int64: each row's index in the batch (on the device)
    row_ids: list[int]  # the same on the host
    running: list[bool]  # [A] False once the row drew a stop token
    prefill_ids: torch.Tensor  # [U, W] the distinct prompts, left-padded
    prompt_of_row: torch.Tensor | None  # [B] int64: row b's prompt in prefill_ids; None once expanded (or all distinct)
    compactable: bool  # B is even: stopped rows may leave

    COMPACT_FRACTION: ClassVar[float] = 1 / 8  # drop stopped rows once they are this share of the batch
    # CPU matmuls (MKL, one thread) of one token per row round a row the same in every batch of an even number
    # >= 4 of rows; batches of 1-3 rows or an odd number take other kernels (measured: tests/rollout/
    # test_engine_equivalence.py). So only an even batch shrinks, and only to an even size >= MIN_ROWS. With
    # several threads the last bit may differ anyway (1 ulp; the test allows it).
    MIN_ROWS: ClassVar[int] = 4

    @classmethod
    def left_padded(cls, prompts: Sequence[Sequence[int]], pad_token_id: int, max_new_tokens: int,
                    device: torch.device) -> _DecodeBatch:
        """The distinct prompts left-padded to the longest (W); position ids restart at each row's first real
        token."""
        index: dict[tuple[int, ...], int] = {}
        prompt_of_row = [index.setdefault(tuple(p), len(index)) for p in prompts]
        distinct, batch, width = list(index), len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((len(distinct), width), pad_token_id, dtype=torch.long)
        attention = torch.zeros(len(distinct), width + max_new_tokens, dtype=torch.long)
        for row, prompt in enumerate(distinct):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention[row, width - len(prompt) : width] = 1
        padded = any(len(p) < width for p in distinct)
        attention = attention.to(device)
        positions = (attention[:, :width].cumsum(-1) - 1).clamp(min=0)
        shared = len(distinct) < batch
        return cls(
            cache=PreallocatedCache(width + max_new_tokens, keep_decode_mask=padded), attention=attention,
            length=width, positions=positions, rows=torch.arange(batch, device=device), row_ids=list(range(batch)),
            running=[True] * batch, prefill_ids=input_ids.to(device),
            prompt_of_row=torch.tensor(prompt_of_row, device=device) if shared else None, compactable=batch % 2 == 0,
        )

    def fan_out(self, per_prompt: torch.Tensor) -> torch.Tensor:
        """Rows [U, ...] of the distinct prompts (the prefill's outputs) -> [B, ...] one per batch row."""
        return per_prompt if self.prompt_of_row is None else per_prompt.index_select(0, self.prompt_of_row)

    def expand(self) -> None:
        """After the prefill: give every row its prompt's cache, mask and positions (nothing to do when the prompts
        were distinct or already expanded)."""
        if self.prompt_of_row is not None:
            self.cache.batch_select_indices(self.prompt_of_row)
            self.attention = self.attention.index_select(0, self.prompt_of_row)
            self.positions = self.positions.index_select(0, self.prompt_of_row)
            self.prompt_of_row = None

    def attention_view(self) -> torch.Tensor:
        """The mask [A, length] of the cached positions plus the next forward's inputs."""
        return self.attention[:, : self.length]

    def advance(self, tokens: torch.Tensor) -> torch.Tensor:
        """Make room for the tokens [A] just drawn; returns the next input ids [A', 1] (A' <= A rows:
        stopped rows dropped when enough have stopped)."""
        self.attention[:, self.length] = 1
        self.length += 1
        self.positions = self.positions[:, -1:] + 1
        keep = self._rows_to_keep()
        if keep is not None:
            keep_t = torch.tensor(keep, device=tokens.device)
            self._keep(keep_t)
            tokens = tokens.index_select(0, keep_t)
        return tokens[:, None]

    def _rows_to_keep(self) -> list[int] | None:
        """The rows to keep once enough have stopped (None: keep the batch as it is): the running ones, and
        stopped ones up to an even count of at least `MIN_ROWS` (see there)."""
        rows = len(self.running)
        stopped = [i for i, run in enumerate(self.running) if not run]
        if not self.compactable or len(stopped) < max(1, self.COMPACT_FRACTION * rows) or rows <= self.MIN_ROWS:
            return None
        running = [i for i, run in enumerate(self.running) if run]
        wanted = max(self.MIN_ROWS, len(running) + len(running) % 2)
        return sorted(running + stopped[: wanted - len(running)])

    def _keep(self, keep: torch.Tensor) -> None:
        """Keep only the rows `keep` [A'] of the batch, its mask and its cache."""
        self.cache.batch_select_indices(keep)
        self.attention = self.attention.index_select(0, keep)
        self.positions = self.positions.index_select(0, keep)
        self.rows = self.rows.index_select(0, keep)
        kept = keep.tolist()
        self.row_ids = [self.row_ids[i] for i in kept]
        self.running = [self.running[i] for i in kept]


class LocalEngine(RolloutEngine):
    """Samples from an HF causal LM on the device its parameters live on (the CPU unless moved).

    The engine owns `model`: with `prepack_weights` (default) its `nn.Linear` layers of >= 2^17 weights are replaced
    in place by `PrepackedLinear`s over the same Parameters, which run float32 CPU products on a oneDNN layout of the
    weights (`rollout/prepacked_linear.py`; one more copy of those weights in memory).
    """

    def __init__(
        self, model: str | Path | PreTrainedModel, *, dtype: torch.dtype = torch.float32, max_batch_size: int = 256,
        pad_token_id: int = 0, weight_precision: EnginePrecision = "fp32", record_routes: bool = False,
        prepack_weights: bool = True,
    ) -> None:
        if weight_precision not in ENGINE_PRECISIONS:
            raise ValueError(f"unknown weight_precision {weight_precision!r}; choose one of {ENGINE_PRECISIONS}")
        if isinstance(model, (str, Path)):
            model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
        self.model = model.eval()
        if prepack_weights:  # before any hook goes on a linear layer: the layers are replaced
            prepack_linears(model)
        # transformers 5.24 renamed forward's `past_key_values` to `cache` (the old name stays an alias for a
        # while); a name the model does not take would vanish into **kwargs and decode without the history.
        parameters = inspect.signature(model.forward).parameters
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"
        self._takes_logits_to_keep = "logits_to_keep" in parameters
        self.max_batch_size = max_batch_size
        self.pad_token_id = pad_token_id
        self.weight_precision = weight_precision
        self.routes = RouteCapture(model) if record_routes else None
        self.adapters = EngineAdapters(model)  # after prepacking: their hooks sit on the layers that run
        self._interrupted = threading.Event()  # `interrupt`: every generation in flight or begun stops
        if weight_precision != "fp32":  # round the loaded weights too
            self.update_weights(list(self.named_parameters_hf().items()))

    @classmethod
    def load(
        cls, settings: LocalEngineConfig, *, model: str | Path | PreTrainedModel, pad_token_id: int,
        device: torch.device | None = None, dtype: torch.dtype = torch.float32, record_routes: bool = False,
    ) -> LocalEngine:
        """An in-process engine of a training run: `model` (a checkpoint directory, loaded, or a model) with the
        rollout.local section's `settings` (its weight precision), padding with the tokenizer's `pad_token_id`, its
        weights in `dtype` on `device` (default: where they are; the trainer passes its GPU and dtype), recording
        routes when `record_routes`."""
        if isinstance(model, torch.nn.Module):
            model = model.to(dtype=dtype)
        engine = cls(model, dtype=dtype, pad_token_id=pad_token_id, weight_precision=settings.engine_precision,
                     record_routes=record_routes)
        if device is not None:
            engine.model.to(device)
        return engine

    @torch.no_grad()
    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
        abort: Callable[[], Collection[int]] | None = None, lora: str | None = None,
    ) -> list[Generation]:
        """`RolloutEngine.generate`; `abort()` (polled before every decode step) names the prompts (indices into
        `prompts`) to stop now: they come back partial (finish_reason "abort"), as every unfinished one does after
        `interrupt`. `lora` names the loaded adapter to sample with (`load_lora_adapter`); None: the base."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        generators = self._generators(sampling, len(prompts))
        out: list[Generation] = []
        with self.adapters.selected(lora):
            for start in range(0, len(prompts), self.max_batch_size):
                chunk = prompts[start : start + self.max_batch_size]
                stopped = self._stopped_rows(abort, start, len(chunk))
                generator = generators[start : start + len(chunk)] if isinstance(generators, list) else generators
                out += self._generate_batch(chunk, sampling, generator, stopped)
        return out

    def _generators(self, sampling: SamplingParams, prompts: int) -> torch.Generator | list[torch.Generator] | None:
        """The call's generator on the engine's device (`sampling.seed`), one CPU generator per prompt
        (`sampling.seeds`), or None (the device's default generator)."""
        if sampling.seeds is not None:
            if len(sampling.seeds) != prompts:
                raise ValueError(f"{len(sampling.seeds)} per-prompt seeds for {prompts} prompts")
            return [torch.Generator().manual_seed(seed) for seed in sampling.seeds]
        return None if sampling.seed is None else torch.Generator(self.device).manual_seed(sampling.seed)

    def _stopped_rows(
        self, abort: Callable[[], Collection[int]] | None, start: int, rows: int
    ) -> Callable[[], Collection[int]]:
        """The rows [0, rows) of the batch of prompts start.. to stop now: all after `interrupt`, else `abort`'s."""

        def stopped() -> Collection[int]:
            if self._interrupted.is_set():
                return range(rows)
            return [] if abort is None else [i - start for i in abort() if start <= i < start + rows]

        return stopped

    def interrupt(self) -> None:
        self._interrupted.set()

    def end_interrupt(self) -> None:
        self._interrupted.clear()

    def _generate_batch(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
        generator: torch.Generator | Sequence[torch.Generator] | None, stopped: Callable[[], Collection[int]],
    ) -> list[Generation]:
        """Prefill the left-padded batch, then decode one token per step for the rows still running; a
        row that draws a stop token leaves the batch (and its KV cache) at the next compaction. Rows `stopped()`
        names before a step end there, with the tokens drawn so far (finish_reason "abort")."""
        batch = _DecodeBatch.left_padded(prompts, self.pad_token_id, sampling.max_new_tokens, self.device)
        stop = torch.tensor(sampling.stop_token_ids or [-1], dtype=torch.long, device=batch.rows.device)
        tokens_out = torch.zeros(len(prompts), max(sampling.max_new_tokens, 1), dtype=torch.long, device=stop.device)
        logprobs_out = torch.zeros(tokens_out.shape, dtype=torch.float32, device=stop.device)
        lengths = [sampling.max_new_tokens] * len(prompts)
        step_ids = batch.prefill_ids
        width = step_ids.shape[1]
        routes = None if self.routes is None else torch.zeros(  # [B, W + max_new_tokens, L, k]: left-padded positions
            len(prompts), width + sampling.max_new_tokens, self.routes.num_layers, self.routes.top_k, dtype=torch.int32,
            device=stop.device)
        for step in range(sampling.max_new_tokens):
            if self._stop_rows(stopped(), batch, lengths, step) and not any(batch.running):
                break
            logits = self._last_logits(step_ids, batch, prefill=step == 0)
            if routes is not None:  # the prefill's W positions, then the token drawn at step - 1, at W + step - 1
                start = 0 if step == 0 else width + step - 1
                routes[batch.rows, start : start + step_ids.shape[1]] = batch.fan_out(self.routes.take(*step_ids.shape))
            logits = batch.fan_out(logits)
            batch.expand()
            tokens, token_logprobs = sample_next_tokens(logits, sampling, generator, batch.rows, len(prompts))
            tokens_out[batch.rows, step], logprobs_out[batch.rows, step] = tokens, token_logprobs
            for row in torch.isin(tokens, stop).nonzero().flatten().tolist():  # the step's one device sync
                if batch.running[row]:
                    batch.running[row] = False
                    lengths[batch.row_ids[row]] = step + 1
            if not any(batch.running):
                break
            step_ids = batch.advance(tokens)
        token_rows, logprob_rows = tokens_out.tolist(), logprobs_out.tolist()
        routes = None if routes is None else routes.cpu()
        return [
            Generation(
                prompt_ids=list(prompt), response_ids=ids[:n], logprobs=lps[:n],
                finish_reason=("stop" if n and ids[n - 1] in sampling.stop_token_ids else
                               "length" if n == sampling.max_new_tokens else "abort"),
                routed_experts=None if routes is None else routes[row, width - len(prompt) : width + n - 1].clone(),
            )
            for row, (prompt, ids, lps, n) in enumerate(zip(prompts, token_rows, logprob_rows, lengths))
        ]

    @staticmethod
    def _stop_rows(rows: Collection[int], batch: _DecodeBatch, lengths: list[int], step: int) -> bool:
        """End the running batch rows among `rows` (indices into the batch) with the `step` tokens drawn so far;
        whether any ended."""
        if not rows:
            return False
        wanted, ended = set(rows), False
        for i, row in enumerate(batch.row_ids):
            if row in wanted and batch.running[i]:
                batch.running[i], lengths[row], ended = False, step, True
        return ended

    def _last_logits(self, step_ids: torch.Tensor, batch: _DecodeBatch, *, prefill: bool) -> torch.Tensor:
        """The logits [A, V] of each row's last position for input ids [A, T] (T = prompt width at the
        prefill, else 1); only the last position goes through the LM head where the model allows it."""
        keep = {"logits_to_keep": 1} if prefill and self._takes_logits_to_keep else {}
        return self.model(
            input_ids=step_ids, attention_mask=batch.attention_view(), position_ids=batch.positions, use_cache=True,
            **{self._cache_argument: batch.cache}, **keep,
        ).logits[:, -1]

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Validate every name and shape first, then copy (rounded to `weight_precision`), so a bad
        update changes nothing. Names are checkpoint names (a fused MoE model's experts one by one)."""
        params = self.named_parameters_hf()
        updates = list(named_tensors)
        for name, tensor in updates:
            if name not in params:
                raise KeyError(f"update_weights: the engine's model has no parameter {name!r}")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(
                    f"update_weights: {name} has shape {tuple(tensor.shape)}, the engine expects {tuple(params[name].shape)}"
                )
        for name, tensor in updates:
            params[name].copy_(quantize_weight(tensor.detach(), self.weight_precision))

    def load_lora_adapter(self, name: str, config: dict, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (or replace) LoRA adapter `name` beside the base weights: PEFT-named tensors and PEFT's config dict
        (`engine_lora.EngineAdapters.load`; rounded to `weight_precision`). Nothing cached outlives a call."""
        self.adapters.load(name, config, named_tensors,
                           functools.partial(quantize_weight, precision=self.weight_precision))

    def load_lora_adapter_from_path(self, name: str, path: str) -> None:
        """`load_lora_adapter` from the PEFT directory at `path`."""
        config, tensors = read_peft_adapter(path)
        self.load_lora_adapter(name, config, tensors.items())

    def unload_lora_adapter(self, name: str) -> None:
        """Drop LoRA adapter `name`."""
        self.adapters.unload(name)

    def release_weight_layouts(self) -> None:
        """Free the prepacked layers' oneDNN copies of the weights (made again from the weights at the next
        generation): for a memory release that frees the weights' storages."""
        drop_layouts(self.model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def named_parameters_hf(self) -> dict[str, torch.Tensor]:
        """The engine's current weights by HF checkpoint name (detached views; its family's
        `ModelFamily.engine_named_views`): parameters and persistent buffers (a router's expert bias)."""
        family = model_family(self.model.config.model_type, source="the engine's model")
        return family.engine_named_views({name: p.detach() for name, p in checkpoint_tensors(self.model).items()})

    def health(self) -> bool:
        return True

    def flush_cache(self) -> None:
        """Nothing to drop: the KV cache lives only inside one `generate` call."""


builds(LocalEngineConfig)(LocalEngine.load)
