"""Anchor cache (`rollout.anchors.cache`): a prompt's anchors are sampled once and reused until the reference resets.

ARMOR regenerates anchors every step (armor.md §1). While the reference is frozen its samples of a
prompt are draws from the same distribution at every step, so reusing them saves the anchor
generation of every prompt seen before. The trainer clears the cache when the reference is reset.

Every rank holds the same all-gathered samples and makes the same calls in the same order, so
every rank's cache is identical; nothing here depends on the rank. A lock guards the cache: with partial rollouts
the asynchronous generator may fetch anchors while the trainer checkpoints it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from megatron_armor.config import AnchorsConfig
from megatron_armor.config.builders import builds
from megatron_armor.data.datasets import PromptRow
from megatron_armor.data.types import Sample

PromptKey = tuple[int, ...]  # a prompt's token ids


@builds(AnchorsConfig)
def anchor_cache(settings: AnchorsConfig) -> AnchorCache | None:
    """The run's anchor cache as rollout.anchors says: None unless its `cache` is on."""
    return AnchorCache(settings) if settings.cache else None


class AnchorCache:
    """Anchors by prompt token ids, at most `settings.cache_max_prompts` prompts (least recently used evicted first);
    a run has one when `settings.cache` (rollout.anchors) is on."""

    def __init__(self, settings: AnchorsConfig) -> None:
        self.settings = settings
        self._anchors: OrderedDict[PromptKey, list[Sample]] = OrderedDict()  # oldest use first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._anchors)

    def fetch(
        self, prompts: Sequence[PromptRow], generate: Callable[[list[PromptRow]], list[Sample]]
    ) -> tuple[list[Sample], int]:
        """Anchors of every prompt, ordered by prompt, each with that prompt's `index` as `prompt_index`.

        `generate(missing)` samples the anchors of the prompts not cached (once per distinct prompt);
        it is not called when every prompt is cached. Returns (anchors, cache hits), the hits
        counting the prompts served from anchors cached before this call.
        """
        keys = [tuple(p.prompt_ids) for p in prompts]
        with self._lock:
            hits = sum(key in self._anchors for key in keys)
            missing = list({key: p for key, p in zip(keys, prompts) if key not in self._anchors}.values())
            anchors = {key: self._anchors[key] for key in keys if key in self._anchors}
        anchors.update({tuple(p.prompt_ids): [] for p in missing})
        key_of = {p.index: tuple(p.prompt_ids) for p in missing}  # by prompt_index: a trajectory's segments have
        for sample in generate(missing) if missing else []:  # prompts of their own
            anchors[key_of[sample.prompt_index]].append(sample)
        with self._lock:
            for key in keys:
                self._store(key, anchors[key])
        served = [dataclasses.replace(a, prompt_index=p.index) for key, p in zip(keys, prompts) for a in anchors[key]]
        return served, hits

    def clear(self) -> None:
        """Forget every anchor (the reference changed)."""
        with self._lock:
            self._anchors.clear()

    def _store(self, key: PromptKey, anchors: list[Sample]) -> None:
        self._anchors[key] = anchors
        self._anchors.move_to_end(key)
        while len(self._anchors) > self.settings.cache_max_prompts:
            self._anchors.popitem(last=False)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state: every cached prompt's token ids and anchors, least recently used first."""
        with self._lock:
            cached = list(self._anchors.items())
        return {
            "prompts": [
                {"prompt_ids": list(key), "anchors": [dataclasses.asdict(a) for a in anchors]}
                for key, anchors in cached
            ]
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._anchors.clear()
            for entry in state["prompts"]:
                self._store(tuple(entry["prompt_ids"]), [Sample(**a) for a in entry["anchors"]])
