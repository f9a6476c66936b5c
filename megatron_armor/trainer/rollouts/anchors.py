"""ARMOR's anchors (armor.md §1) as one rollout source: what an algorithm whose `StepSources.extra_samples` names
`ANCHORS` gets, and nothing the trainer spreads elsewhere.

`AnchorSource` samples `ref_n` anchors of every prompt of a generation batch from the reference's engine (pushing the
reference's weights first into an engine it shares with the actor), or serves them from the anchor cache
(`rollout.anchors.cache`, trainer/rollouts/anchor_cache.py; cleared when the reference changes, carried in the
trainer's state); `build_groups` keeps a group only with a correct one (`require_anchor`). Its `metrics` are what the
anchors add to a rollout's. In the overlapped rollout modes the anchors are sampled ahead on a thread of their own
(trainer/rollouts/anchor_prefetch.py), which calls this source's `sample` over the thread's process group.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from megatron_armor.algorithms import ANCHORS, trajectories
from megatron_armor.data.datasets import PromptRow
from megatron_armor.data.types import Sample
from megatron_armor.trainer.colocation.engine_weights import EngineWeights
from megatron_armor.trainer.rollouts.anchor_cache import AnchorCache
from megatron_armor.trainer.rollouts.anchor_prefetch import ANCHOR_SEED_TAG, anchor_key
from megatron_armor.trainer.rollouts.samples import (
    RolloutCounters, SampleScorer, engine_counters, generate_samples, mean,
)
from megatron_armor.trainer.step_inputs.policies import Policy

if TYPE_CHECKING:
    from megatron_armor.rollout.base import SamplingParams


class AnchorSource:
    """The anchors of a run: `ref_n` samples per prompt from `policy` (the reference) with the rollouts' `sampling`,
    scored by their `scorer`, through `cache` when there is one; `engine_weights` loads the reference's weights into
    an engine it shares with the actor. Every rank holds the same source and makes the same calls (collective where
    it samples)."""

    name = ANCHORS
    seed_tag = ANCHOR_SEED_TAG  # the tag of the anchors' sampling seeds (`RolloutPhase.seed`), with their `key`

    def __init__(
        self, policy: Policy, ref_n: int, cache: AnchorCache | None = None, *, engine_weights: EngineWeights,
        sampling: SamplingParams, scorer: SampleScorer,
    ) -> None:
        self.policy, self.ref_n, self.cache = policy, ref_n, cache
        self.engine_weights, self.sampling, self.scorer = engine_weights, sampling, scorer

    @staticmethod
    def key(position: dict[str, Any]) -> tuple:
        """The key of the anchors of the generation batch drawn at sampler `position`: their seed derives from it, not
        from the step, so they can be sampled ahead (`anchor_prefetch.anchor_key`)."""
        return anchor_key(position)

    def sample(
        self, prompts: list[PromptRow], seed: tuple, counters: RolloutCounters, *, group: dist.ProcessGroup | None,
    ) -> list[Sample]:
        """`ref_n` anchors of every prompt, sampled with `seed` over `group` (collective) or from the cache; the time
        (reference pushes included), the pushes and the cache hits count in `counters`."""
        start = time.perf_counter()

        def generate(missing: list[PromptRow]) -> list[Sample]:
            counters.add_push(self.engine_weights.load(self.policy), anchors=True)
            return generate_samples(self.policy.engine, missing, self.ref_n, self.sampling, self.scorer,
                                    is_anchor=True, seed=seed, group=group)

        if self.cache is None:
            anchors = generate(prompts)
        else:
            anchors, hits = self.cache.fetch(prompts, generate)
            counters.anchor_cache_hits += hits
        counters.anchor_seconds += time.perf_counter() - start
        return anchors

    def metrics(
        self, groups: list[list[Sample]], anchors: Sequence[list[Sample]], counters: RolloutCounters, *,
        shared_engine: bool, group: dist.ProcessGroup | None,
    ) -> dict[str, float]:
        """What the anchors (trajectories: each its samples) add to a rollout's metrics: their accuracy, the fraction
        of on-policy trajectories among the kept groups' (armor.md §7), their time, cache hits (with a cache), an
        engine shared with the actor's pushes, and a reference engine of its own its counters as rollout/ref_* (summed
        over `group`: collective)."""
        metrics = {}
        if anchors:
            metrics["armor/anchor_accuracy"] = mean([float(t[0].correct) for t in anchors])
        if groups:
            metrics["mix_kl/main_ratio"] = mean([float(not t[0].is_anchor) for g in groups for t in trajectories(g)])
        metrics["perf/anchor_rollout_seconds"] = counters.anchor_seconds
        if self.cache is not None:
            metrics["armor/anchor_cache_hits"] = float(counters.anchor_cache_hits)
        if shared_engine:
            metrics.update({
                "perf/ref_weight_push_seconds": counters.ref_push_seconds,
                "perf/actor_weight_restore_seconds": counters.actor_restore_seconds,
                "rollout/weight_swaps": float(counters.weight_swaps),
            })
        else:
            ref_counts = engine_counters(self.policy.engine, group)
            metrics.update({name.replace("rollout/", "rollout/ref_", 1): value for name, value in ref_counts.items()})
        return metrics

    def reference_changed(self) -> None:
        """The reference was reset: anchors cached from the old one are dropped."""
        if self.cache is not None:
            self.cache.clear()

    def state_dict(self) -> dict[str, Any] | None:
        """The cache's state (JSON-able), None without a cache."""
        return None if self.cache is None else self.cache.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.cache is not None:
            self.cache.load_state_dict(state)
