"""`AdapterEngine`: a LoRA actor on an engine that holds the base (model.lora.weight_sync adapter).

The engine (in-process, or SGLang / serve-local servers) loads the base once; the actor is the engine seen through
this view, which generates with the actor's adapter and whose weight pushes replace that adapter (PEFT-named
tensors: `RolloutEngine.load_lora_adapter`; with a push directory, written there in PEFT's format and loaded by
path: `RolloutEngine.load_lora_adapter_from_path`, for servers on other hosts). The engine itself, without the view,
is the base: the reference of a LoRA run samples ARMOR's anchors from it, so no reference engine or servers exist. A
push through the view moves the adapter's bytes alone (`weight_sync.sync_weights` counts them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from megatron_armor.rollout.adapter_dir import AdapterDir
from megatron_armor.rollout.base import EngineView, Generation, RolloutEngine, SamplingParams


class AdapterEngine(EngineView):
    """`engine` generating with its LoRA adapter `name`, whose `update_weights` loads that adapter from PEFT-named
    tensors with PEFT's config dict, `config(<the tensors' names>)` (`LoRAConfig.peft_config`): handed over as they
    are, or with `push_dir` written there as a new version and loaded by its path. Everything else is the engine's
    own: its servers, health, interrupts, caches and counters."""

    def __init__(self, engine: RolloutEngine, name: str, config: Callable[[list[str]], dict],
                 push_dir: AdapterDir | None = None) -> None:
        super().__init__(engine)
        self.name, self.config, self.push_dir = name, config, push_dir

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, **options: Any) -> list[Generation]:
        """The engine's generations with the adapter (`options`: the engine's own, e.g. a local engine's abort)."""
        return self.engine.generate(prompts, sampling, lora=self.name, **options)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the adapter by `named_tensors` (PEFT-named A and B of every adapted layer; drawn whole first, an
        adapter is small); the base stays."""
        tensors = list(named_tensors)
        config = self.config([name for name, _ in tensors])
        if self.push_dir is None:
            self.engine.load_lora_adapter(self.name, config, tensors)
        else:
            self.engine.load_lora_adapter_from_path(self.name, str(self.push_dir.write(dict(tensors), config)))

    def load_lora_adapter(self, name: str, config: dict, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.engine.load_lora_adapter(name, config, named_tensors)

    def load_lora_adapter_from_path(self, name: str, path: str) -> None:
        self.engine.load_lora_adapter_from_path(name, path)

    @property
    def urls(self) -> list[str]:
        return self.engine.urls

    def missed_push(self) -> set[str]:
        return self.engine.missed_push()

    def retire_servers(self, urls: set[str]) -> None:
        self.engine.retire_servers(urls)

    def interrupt(self) -> None:
        self.engine.interrupt()

    def end_interrupt(self) -> None:
        self.engine.end_interrupt()
