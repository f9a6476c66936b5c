"""ARMOR's anchors (armor.md §1) as one rollout source: what an algorithm whose `StepSources.extra_samples` names
`ANCHORS` gets, and nothing the trainer spreads elsewhere.

`AnchorSource` samples `ref_n` anchors of every prompt of a generation batch from the reference's engine (pushing the
reference's weights first into an engine it shares with the actor), or serves them from the anchor cache
(`rollout.anchors.cache`, trainer/rollouts/anchor_cache.py; cleared when the reference changes, carried in the
trainer's state); `build_groups` keeps a group only with a correct one (`require_anchor`). It decides, per generation
batch (`open`, the protocol of trainer/rollouts/extra_sources.py), how the anchors interleave with the on-policy
samples: before them when the engine of the policy that samples those holds another policy's weights (an engine shared
by two policies samples first with the weights it holds, so a batch swaps them at most once: with one generation batch
per step one reference push per step, the actor's weights being pushed after the update anyway), else after them; and
in the overlapped rollout modes (`sample_ahead`), with a reference engine of its own, sampled ahead on a thread of
their own (trainer/rollouts/anchor_prefetch.py). Their seeds derive from train.seed and the sampler position the
batch's prompts are drawn at (`seed`), not from the step, so they are the same sampled now or ahead. Its `metrics` are
what the anchors add to a rollout's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from megatron_armor.algorithms import ANCHORS, REFERENCE, trajectories
from megatron_armor.data.datasets import PromptRow
from megatron_armor.data.types import Sample
from megatron_armor.trainer.colocation.engine_weights import EngineWeights
from megatron_armor.trainer.rollouts.anchor_cache import AnchorCache
from megatron_armor.trainer.rollouts.anchor_prefetch import AnchorPrefetch
from megatron_armor.trainer.rollouts.extra_sources import DrawnBatch
from megatron_armor.trainer.rollouts.samples import (
    RolloutCounters, SampleScorer, engine_counters, generate_samples, mean,
)
from megatron_armor.trainer.step_inputs.policies import Policy

if TYPE_CHECKING:
    from megatron_armor.rollout.base import SamplingParams


class AnchorSource:
    """The anchors of a run (an `ExtraSampleSource`): `ref_n` samples per prompt from `policy` (the reference) with
    the rollouts' `sampling`, scored by their `scorer`, seeded from `train_seed`, through `cache` when there is one;
    `engine_weights` loads the reference's weights into an engine it shares with the actor. Every rank holds the same
    source and makes the same calls (collective where it samples)."""

    name = ANCHORS

    def __init__(
        self, policy: Policy, ref_n: int, cache: AnchorCache | None = None, *, engine_weights: EngineWeights,
        sampling: SamplingParams, scorer: SampleScorer, train_seed: int,
    ) -> None:
        self.policy, self.ref_n, self.cache = policy, ref_n, cache
        self.engine_weights, self.sampling, self.scorer = engine_weights, sampling, scorer
        self.train_seed = train_seed
        self._ahead: tuple[dist.ProcessGroup | None, int] | None = None  # `sample_ahead`'s group and depth
        self._prefetch: AnchorPrefetch | None = None  # made by the first batch that samples its anchors ahead

    def seed(self, position: dict[str, Any]) -> tuple:
        """The sampling seed of the anchors of the generation batch drawn at sampler `position`: train.seed, this
        source's name, the position and the reference's name (derived from the position, not the step, so they can
        be sampled ahead)."""
        return (self.train_seed, ANCHORS, *position.values(), REFERENCE)

    def open(self, batch: DrawnBatch) -> AnchorBatch:
        """The anchors of generation batch `batch`: taken before its on-policy samples when the engine of the policy
        that samples those (`batch.policy`) holds another policy's weights, else after them; sampled ahead (submitted
        here, with the `depth` batches after it) when `sample_ahead` was asked for and the reference's engine is its
        own, else when taken."""
        prefetch = self._prefetch_beside(batch.policy)
        if prefetch is not None:
            prefetch.submit_ahead(batch.sampler, batch.position)
        return AnchorBatch(self, batch, prefetch, before_on_policy=not batch.policy.holds_weights)

    def sample_ahead(self, group: dist.ProcessGroup | None, depth: int) -> None:
        """Sample anchors ahead from now on, on a thread whose collectives run over `group`, up to `depth` generation
        batches beyond the one in use, with a reference engine of its own (one shared with the policy that samples
        the training responses samples them in the batch, its weights swapped in). The thread starts with the first
        batch that needs it (none for an algorithm without anchors)."""
        self._ahead = (group, depth)

    def drain_ahead(self) -> None:
        """Wait until the anchors submitted ahead are sampled (the anchor cache stands still)."""
        if self._prefetch is not None:
            self._prefetch.drain()

    def drop_ahead(self) -> None:
        """Drain, then drop the anchors sampled ahead (they came from the old reference)."""
        if self._prefetch is not None:
            self._prefetch.reset()

    def _prefetch_beside(self, sampler: Policy) -> AnchorPrefetch | None:
        """The thread that samples anchors ahead, beside `sampler`'s engine (made the first time); None without
        `sample_ahead` or when `sampler`'s engine is the reference's."""
        if self._ahead is None or self.policy.engine is sampler.engine:
            return None
        if self._prefetch is None:
            self._prefetch = AnchorPrefetch(self, *self._ahead)
        return self._prefetch

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
        policy: Policy, group: dist.ProcessGroup | None,
    ) -> dict[str, float]:
        """What the anchors (trajectories: each its samples) add to a rollout's metrics: their accuracy, the fraction
        of on-policy trajectories among the kept groups' (armor.md §7), their time, cache hits (with a cache), an
        engine shared with `policy` (which samples the training responses) its pushes, and a reference engine of its
        own its counters as rollout/ref_* (summed over `group`: collective)."""
        metrics = {}
        if anchors:
            metrics["armor/anchor_accuracy"] = mean([float(t[0].correct) for t in anchors])
        if groups:
            metrics["mix_kl/main_ratio"] = mean([float(not t[0].is_anchor) for g in groups for t in trajectories(g)])
        metrics["perf/anchor_rollout_seconds"] = counters.anchor_seconds
        if self.cache is not None:
            metrics["armor/anchor_cache_hits"] = float(counters.anchor_cache_hits)
        if self.policy.engine is policy.engine:
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


@dataclass(frozen=True)
class AnchorBatch:
    """One generation batch's anchors (`AnchorSource.open`, an `ExtraSamples`): sampled ahead by `prefetch`, or by
    `source` when taken (collective over the batch's group)."""

    source: AnchorSource
    batch: DrawnBatch
    prefetch: AnchorPrefetch | None
    before_on_policy: bool

    def take(self) -> list[Sample]:
        """The batch's `ref_n` anchors of each of its prompts; their time (the wait for them, sampled ahead) and
        pushes count in the batch's counters."""
        batch = self.batch
        if self.prefetch is not None:
            return self.prefetch.take(batch.position, batch.counters)
        return self.source.sample(batch.prompts, self.source.seed(batch.position), batch.counters, group=batch.group)
