"""In-process rollout engine: an HF transformers model with batched, KV-cached sampling.

The CPU default behind `RolloutEngine`; the SGLang client implements the same interface for GPU
clusters. Prompts are left-padded into one batch (position ids restart at each row's first real
token) and decoded incrementally with HF's `DynamicCache`, on the device the model lives on.

`weight_precision` ("fp32" | "bf16" | "fp8", see `rollout/precision.py`) rounds the weights the
engine loads and receives, so its logprobs differ from the trainer's the way production engines do.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from megatron_armor.config import RolloutConfig
from megatron_armor.rollout.base import Generation, RolloutEngine, SamplingParams
from megatron_armor.rollout.expert_views import checkpoint_named_views
from megatron_armor.rollout.precision import ENGINE_PRECISIONS, EnginePrecision, quantize_weight


def sample_next_tokens(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row. logits: [B, V] float32 -> (tokens [B] int64, logprobs [B] float32).

    logprobs are log_softmax(logits / T) of the drawn token before top-p filtering (SGLang
    semantics); T = 0 is greedy with the unscaled log_softmax.
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
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


class LocalEngine(RolloutEngine):
    """Samples from an HF causal LM on the device its parameters live on (the CPU unless moved)."""

    def __init__(
        self, model: str | Path | PreTrainedModel, *, dtype: torch.dtype = torch.float32, max_batch_size: int = 256,
        pad_token_id: int = 0, weight_precision: EnginePrecision = "fp32",
    ) -> None:
        if weight_precision not in ENGINE_PRECISIONS:
            raise ValueError(f"unknown weight_precision {weight_precision!r}; choose one of {ENGINE_PRECISIONS}")
        if isinstance(model, (str, Path)):
            model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
        self.model = model.eval()
        # transformers 5.24 renamed forward's `past_key_values` to `cache` (the old name stays an alias for a
        # while); a name the model does not take would vanish into **kwargs and decode without the history.
        self._cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.max_batch_size = max_batch_size
        self.pad_token_id = pad_token_id
        self.weight_precision = weight_precision
        if weight_precision != "fp32":  # round the loaded weights too
            self.update_weights(list(self.named_parameters_hf().items()))


    @classmethod
    def from_config(cls, model: str | Path | PreTrainedModel, rollout: RolloutConfig, *, pad_token_id: int) -> LocalEngine:
        """An in-process engine of a training run: `model` (a checkpoint directory or a model) with the rollout
        section's weight precision (rollout.engine_precision), padding with the tokenizer's `pad_token_id`."""
        return cls(model, pad_token_id=pad_token_id, weight_precision=rollout.engine_precision)
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Generation]:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        device = self.device
        generator = torch.Generator(device).manual_seed(sampling.seed) if sampling.seed is not None else None
        out: list[Generation] = []
        for start in range(0, len(prompts), self.max_batch_size):
            out += self._generate_batch(prompts[start : start + self.max_batch_size], sampling, generator)
        return out

    def _generate_batch(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, generator: torch.Generator | None
    ) -> list[Generation]:
        batch, width = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros(batch, width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(list(prompt))
            attention[row, width - len(prompt) :] = 1
        device = self.device
        input_ids, attention = input_ids.to(device), attention.to(device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        stop = torch.tensor(sampling.stop_token_ids or [-1], dtype=torch.long, device=device)
        responses: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        step_ids = input_ids
        for _ in range(sampling.max_new_tokens):
            logits = self.model(
                input_ids=step_ids, attention_mask=attention, position_ids=positions, use_cache=True,
                **{self._cache_argument: cache},
            ).logits[:, -1]
            tokens, token_logprobs = sample_next_tokens(logits, sampling, generator)
            token_list, logprob_list = tokens.tolist(), token_logprobs.tolist()  # one device sync per step
            for row in (~finished).nonzero().flatten().tolist():
                responses[row].append(token_list[row])
                logprobs[row].append(logprob_list[row])
            finished |= torch.isin(tokens, stop)
            if bool(finished.all()):
                break
            step_ids = tokens[:, None]
            attention = torch.cat([attention, attention.new_ones(batch, 1)], dim=1)
            positions = positions[:, -1:] + 1
        return [
            Generation(
                prompt_ids=list(prompt), response_ids=ids, logprobs=lps,
                finish_reason="stop" if ids and ids[-1] in sampling.stop_token_ids else "length",
            )
            for prompt, ids, lps in zip(prompts, responses, logprobs)
        ]

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

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def named_parameters_hf(self) -> dict[str, torch.Tensor]:
        """The engine's current weights by HF checkpoint name (detached views; `expert_views`)."""
        return checkpoint_named_views({name: p.detach() for name, p in self.model.named_parameters()})

    def health(self) -> bool:
        return True

    def flush_cache(self) -> None:
        """Nothing to drop: the KV cache lives only inside one `generate` call."""
