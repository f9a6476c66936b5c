"""The rollout-engine interface shared by the in-process engine and the SGLang client."""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from megatron_armor.config import SamplingConfig
from megatron_armor.config.builders import builds


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings for one `generate` call (SGLang `sampling_params` semantics; named after that request
    field, as it is the request's payload rather than a config section).

    Not a config section: a request's payload, which evaluation, validation datasets and the warm start fill in
    themselves; a training run's join rollout.sampling with the tokenizer's stop tokens (not config) where the run
    is built (`sampling_params`), and a call adds its seeds.

    `top_p` filtering happens after temperature scaling; reported logprobs are taken before it.
    `seed` makes a call reproducible for a given engine state; None draws from the engine's generator.
    `seeds` (one per prompt of the call, instead of `seed`): prompt i's draws come from `seeds[i]` alone, so its
    completion does not depend on the call's other prompts, how many there are or where it stands among them (how
    evaluation samples the same responses at any number of data-parallel ranks).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    seeds: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.seed is not None and self.seeds is not None:
            raise ValueError("give a call's seed or its per-prompt seeds, not both")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@builds(SamplingConfig)
def sampling_params(
    sampling: SamplingConfig, *, stop_token_ids: tuple[int, ...], validation: bool = False,
) -> SamplingParams:
    """A run's sampling as rollout.sampling says, stopping at the tokenizer's `stop_token_ids`: the training
    rollouts' (temperature, top_p), or with `validation` validation's (val_temperature, val_top_p); max_new_tokens for
    both."""
    if validation:
        return SamplingParams(sampling.val_temperature, sampling.val_top_p, sampling.max_new_tokens, stop_token_ids)
    return SamplingParams(sampling.temperature, sampling.top_p, sampling.max_new_tokens, stop_token_ids)


GenerationFinish = Literal["stop", "length", "abort"]  # abort: interrupted (`RolloutEngine.interrupt`), partial


@dataclass
class Generation:
    """One sampled completion, or a partial one: finish_reason "abort" when `RolloutEngine.interrupt` stopped it
    before a stop token or the token limit (its tokens so far; it may be continued, rollout/pausable.py).

    response_ids: [R] generated token ids, including the stop token when one was emitted.
    logprobs:     [R] float, log_softmax(logits / T) of each generated token, taken before top-p
                  (SGLang's `output_token_logprobs`); for greedy (T=0) the unscaled log_softmax.
    routed_experts: [P + R - 1, L, k] int32 or None (engines asked to record routes, MoE models): the experts
                  each token the engine fed through the model (the prompt, then every response token but the last,
                  which is sampled and never fed) was routed to in each of the L decoder layers (0 in dense layers);
                  SGLang's `meta_info.routed_experts` (`sglang_protocol.decode_routed_experts`).
    versions:     [R] int or None: the weight version that sampled each token (set by `PausableEngine`, whose
                  generations may continue under newer weights); None: the engine does not track versions.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: GenerationFinish
    routed_experts: torch.Tensor | None = None
    versions: list[int] | None = None


class RolloutEngine(abc.ABC):
    """Generates completions from a policy whose weights the trainer pushes in.

    Weights cross this interface in Hugging Face parameter naming, so any HF-compatible server
    (the in-process engine, SGLang) can receive them.

    `shared_across_ranks`: True when every trainer rank talks to the same engine (remote servers),
    so each server gets the weights from one rank, not from every rank.
    `pushes_weights`: whether this rank's `update_weights` reaches any of them (of a shared engine, each
    rank pushes to the servers dealt to it, and a rank dealt none only takes part in the gather).
    """

    shared_across_ranks: bool = False
    pushes_weights: bool = True

    def metrics(self) -> dict[str, float]:
        """Cumulative engine counters to log (e.g. `rollout/retries`); none by default."""
        return {}

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Generation]:
        """Sample one completion per prompt; output order matches `prompts`."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace parameters by HF name; every name must exist and every shape must match. Afterwards
        nothing computed with the old weights (KV/prefix caches) is served: no `flush_cache` call needed."""

    @abc.abstractmethod
    def health(self) -> bool:
        """True when the engine can serve requests."""

    def close(self) -> None:
        """Release what the engine holds besides its weights (e.g. a weight-update process group);
        idempotent, and the engine stays usable."""

    def release_transfer_buffers(self) -> None:
        """Free what this side keeps between weight pushes only to speed them up (e.g. staging buffers on
        the trainer's GPU); the next push allocates them again."""

    @property
    def urls(self) -> list[str]:
        """The servers this engine generates on (none for an in-process engine)."""
        return []

    def missed_push(self) -> set[str]:
        """The servers (of `urls`) that this engine's last `update_weights` could not reach."""
        return set()

    def retire_servers(self, urls: set[str]) -> None:
        """Generate only on the servers not in `urls` (they missed a weight push); the others serve again."""

    def interrupt(self) -> None:
        """Make the `generate` calls in flight return soon, each unfinished generation partial (finish_reason
        "abort", its tokens and logprobs so far), and calls made until `end_interrupt` return at once the same way.
        By default an engine cannot interrupt: its calls run to their end."""

    def end_interrupt(self) -> None:
        """Generate normally again after `interrupt`."""

    @abc.abstractmethod
    def flush_cache(self) -> None:
        """Drop cached KV/prefix state (`update_weights` does so itself)."""

    def load_lora_adapter(self, name: str, config: dict, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (or replace) LoRA adapter `name` beside the weights the engine holds, from Hugging Face PEFT-named
        tensors (`base_model.model.<layer>.lora_A.weight`, `.lora_B.weight`) and PEFT's config dict (r, lora_alpha,
        target_modules); an engine with LoRA generates with it when a call names it (`generate(..., lora=name)`),
        and without any when none is named. By default an engine has no LoRA."""
        raise NotImplementedError(f"{type(self).__name__} cannot hold LoRA adapters: set model.lora.weight_sync "
                                  f"merged to push merged weights")

    def load_lora_adapter_from_path(self, name: str, path: str) -> None:
        """`load_lora_adapter` from an adapter directory in PEFT's format at `path` (`adapter_config.json`,
        `adapter_model.safetensors`) that the engine (its servers) can read: SGLang's /load_lora_adapter."""
        raise NotImplementedError(f"{type(self).__name__} cannot load LoRA adapters from a path: unset "
                                  f"model.lora.push_dir")


class EngineView(RolloutEngine):
    """`engine` seen through a view that changes part of what it does (`PausableEngine`: pauses around pushes;
    `AdapterEngine`: generates with a LoRA adapter): what the view does not override is the engine's own (where
    its servers are, weight pushes, health, caches, counters, closing)."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine

    @property
    def shared_across_ranks(self) -> bool:  # type: ignore[override]
        return self.engine.shared_across_ranks

    @property
    def pushes_weights(self) -> bool:  # type: ignore[override]
        return self.engine.pushes_weights

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.engine.update_weights(named_tensors)

    def health(self) -> bool:
        return self.engine.health()

    def flush_cache(self) -> None:
        self.engine.flush_cache()

    def metrics(self) -> dict[str, float]:
        return self.engine.metrics()

    def close(self) -> None:
        self.engine.close()

    def release_transfer_buffers(self) -> None:
        self.engine.release_transfer_buffers()
