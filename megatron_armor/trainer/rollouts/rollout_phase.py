"""The rollout phase of an RL step: generate and score samples, group them, until the batch is full.

Generation batches of prompts are sampled from the rollout sources the algorithm asks for (`Algorithm.sources`: the
policy that samples the training responses, and the sources whose samples join the groups, ARMOR's anchors:
trainer/rollouts/anchors.py), scored (`samples.generate_samples`) and grouped (`algorithms.build_groups`), one
`GenerationBatch` at a time, until `train_batch_size` prompts survive filtering (ARMOR §1); `assemble` turns the
batches into the step's `Rollout`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from megatron_armor.agentic.metrics import AgentCounts
from megatron_armor.algorithms import (
    ACTOR, ANCHORS, GroupCollector, GroupStats, anchor_trajectories, build_groups, trajectories,
)
from megatron_armor.data.datasets import PromptRow, PromptSampler
from megatron_armor.data.types import Sample
from megatron_armor.distributed.reduce import sum_over_ranks
from megatron_armor.rollout.base import SamplingParams
from megatron_armor.trainer.colocation.engine_weights import EngineWeights
from megatron_armor.trainer.rollouts.anchor_prefetch import AnchorPrefetch, anchor_key
from megatron_armor.trainer.rollouts.anchors import AnchorSource
from megatron_armor.trainer.rollouts.samples import (
    RolloutCounters, SampleScorer, engine_counters, generate_samples, mean,
)
from megatron_armor.trainer.step_inputs.plan import StepPlan
from megatron_armor.trainer.step_inputs.policies import PolicyHandles


@dataclass(frozen=True)
class RolloutSources:
    """Where a step's samples come from: the training prompts, how responses are sampled, how they are scored."""

    sampler: PromptSampler
    sampling: SamplingParams
    scorer: SampleScorer


@dataclass
class Rollout:
    """What the rollout phase hands on: the kept groups (every rank holds the same ones, each group a
    prompt's on-policy samples and, for ARMOR, its anchor), the rollout's metrics, and per group the weight version
    that sampled its samples: the actor engine's `RolloutSchedule.version` (updates kept so far) while it generated
    (`versions[i]` is `groups[i]`'s; the schedule that hands the rollout on sets them)."""

    groups: list[list[Sample]]
    metrics: dict[str, float]
    versions: list[int] = dataclasses.field(default_factory=list)

    @property
    def version(self) -> int | None:
        """The oldest weight version among the groups (None without groups)."""
        return min(self.versions, default=None)

    def sampled_by(self, version: int) -> Rollout:
        """This rollout with every group sampled by weight version `version`."""
        return dataclasses.replace(self, versions=[version] * len(self.groups))


@dataclass
class GenerationBatch:
    """One generation batch of prompts, sampled, scored and grouped (the same on every rank): the groups that
    survived filtering, the filter's counts, every on-policy sample and every sample of the extra sources (ARMOR's
    anchors; for the metrics) and what the batch spent on anchors and weight swaps."""

    groups: list[list[Sample]]
    stats: GroupStats
    on_policy: list[Sample]
    extra: list[Sample]
    counters: RolloutCounters


class RolloutPhase:
    """Generates, scores and groups a step's samples (collective: every rank makes the same calls).

    Holds no state of its own: the prompt position is the `sampler`'s, cached anchors the anchor source's, what the
    engines hold the policies' (`Policy.holds_weights`, kept by `engine_weights`) and anchors sampled ahead
    `anchors_ahead`'. Its collectives run over `group` (default: the default group; background rollouts,
    trainer/rollouts/rollout_schedule.py, have one of their own).
    """

    def __init__(
        self, plan: StepPlan, models: PolicyHandles, sources: RolloutSources, engine_weights: EngineWeights,
        anchors: AnchorSource, dp_size: int, group: dist.ProcessGroup | None = None,
    ) -> None:
        self.plan, self.models = plan, models
        self.sampler, self.sampling, self.scorer = sources.sampler, sources.sampling, sources.scorer
        self.engine_weights, self.dp_size = engine_weights, dp_size
        self.anchors = anchors  # the source `anchors_ahead` samples from
        self.extra_sources = {anchors.name: anchors}  # the sources an algorithm may add samples from, by name
        self.group = group
        self.anchors_ahead: AnchorPrefetch | None = None  # set by the overlapped rollout modes

    def collect(self, step: int) -> Rollout:
        """Generate until `train_batch_size` prompts survive filtering (ARMOR §1); the rollout's metrics are summed
        over ranks on this phase's group."""
        collector = self.new_collector()
        batches = []
        while not collector.done:
            batches.append(self.generation_batch((step, collector.num_gen_batches)))
            collector.add(batches[-1].groups, batches[-1].stats)
        return self.assemble(collector, batches, self.group)

    def new_collector(self) -> GroupCollector:
        """An empty collector of one step's groups (train_batch_size prompts, within max_num_gen_batches)."""
        prompts, section = self.plan.train.train_batch_size, self.plan.algorithm_section
        return GroupCollector(target_prompts=prompts, max_num_gen_batches=section.max_num_gen_batches,
                              allow_partial=section.allow_partial_batch)

    def generation_batch(self, key: tuple, on_actor_done: Callable[[], None] | None = None) -> GenerationBatch:
        """Draw the sampler's next batch of prompts, sample, score and group it (collective over this phase's
        group): the training responses from the algorithm's sampler, then its extra sources' samples (ARMOR's
        anchors), those first when the sampler's engine holds another policy's weights (an engine shared by two
        policies samples first with the weights it holds, so a batch swaps them at most once: with one generation
        batch per step one reference push per step, the actor's weights being pushed after the update anyway).

        The training responses' sampling seeds derive from train.seed and `key`, the anchors' from train.seed and the
        sampler position the prompts were drawn at (`anchor_key`: anchors can be sampled before the batch is, in any
        mode). With `anchors_ahead` (the overlapped rollout modes) the anchors are sampled on a thread of their own,
        ahead of the batch or while the actor samples it (trainer/rollouts/anchor_prefetch.py). `on_actor_done()` is
        called once the training responses are drawn (the actor's engine is done with the batch)."""
        plan = self.plan  # the anchor action may switch it while the batch waits for its anchors
        counters = RolloutCounters(audit=self.scorer.audits.new_counts() if self.scorer.audits.names else None,
                                   agent=AgentCounts() if self.scorer.rolls_out_trajectories else None)
        position = self.sampler.state_dict()
        prompts = self.draw_prompts(self.sampler)
        extras = [self.extra_sources[name] for name in plan.algorithm.sources.extra_samples]
        ahead = self.anchors_ahead if extras and self.samples_anchors_ahead else None
        if ahead is not None:
            ahead.submit_ahead(self, position)

        def sample_extras() -> list[Sample]:
            if ahead is not None:
                return ahead.take(anchor_key(position), counters)
            seeds = [self.seed(source.key(position), source.seed_tag) for source in extras]
            return [s for source, seed in zip(extras, seeds)
                    for s in source.sample(prompts, seed, counters, group=self.group)]

        sampler_first = self.models.policy(plan.algorithm.sources.sampler).holds_weights
        extra = [] if sampler_first else sample_extras()
        on_policy = self.sample_on_policy(prompts, self.seed(key, ACTOR), counters)
        if on_actor_done is not None:
            on_actor_done()
        if sampler_first:
            extra = sample_extras()
        groups, stats = build_groups(on_policy + extra, require_anchor=bool(extras),
                                     filter_groups=plan.algorithm.filters_groups)
        return GenerationBatch(groups, stats, on_policy, extra, counters)

    @property
    def samples_anchors_ahead(self) -> bool:
        """Whether `generation_batch` takes its anchors from `anchors_ahead`: with a reference engine of its own (a
        shared one samples them after the actor's samples, with the reference's weights swapped in)."""
        return self.anchors_ahead is not None and not self.models.shared_engine

    @staticmethod
    def draw_prompts(sampler: PromptSampler) -> list[PromptRow]:
        """`sampler`'s next batch of prompts, each indexed by its place in the batch."""
        return [dataclasses.replace(p, index=i) for i, p in enumerate(sampler.next_batch())]

    def seed(self, key: tuple, tag: str) -> tuple:
        """The sampling seed of the samples tagged `tag` in the generation batch `key`: ACTOR for the training
        responses, an extra source's `seed_tag` for its samples."""
        return (self.plan.train.seed, *key, tag)

    def assemble(
        self, collector: GroupCollector, batches: list[GenerationBatch], group: dist.ProcessGroup | None,
    ) -> Rollout:
        """The rollout of the groups `collector` gathered from `batches` (its versions unset), with their metrics
        (audit counts summed over `group`: collective). A partial batch (allow_partial_batch) is cut to a multiple of
        the data-parallel size (`trim_to_data_parallel`); it may then be empty."""
        groups = trim_to_data_parallel(collector.result(), self.dp_size)
        counters = RolloutCounters.merged([batch.counters for batch in batches])
        on_policy = [t for batch in batches for t in trajectories(batch.on_policy)]
        extra = [t for batch in batches for t in trajectories(batch.extra)]
        return Rollout(groups, self.metrics(groups, on_policy, extra, collector, counters, group))

    def sample_on_policy(self, prompts: list[PromptRow], seed: tuple, counters: RolloutCounters) -> list[Sample]:
        """`actor_n` scored samples of every prompt from the engine of the algorithm's sampler (collective).

        That is the actor's, or for OPD's off-policy variant the teacher's: the student then trains on the teacher's
        tokens with the same r_t and loss, and no importance weight corrects for sampling from q_T instead of pi_old
        (as in opd.md §1, variants).
        """
        sampler = self.models.policy(self.plan.algorithm.sources.sampler)
        counters.add_push(self.engine_weights.load(sampler), anchors=False)
        return generate_samples(
            sampler.engine, prompts, self.plan.actor_n, self.sampling, self.scorer, is_anchor=False, seed=seed,
            audit=counters.audit, agent=counters.agent, group=self.group,
        )

    def metrics(
        self, groups: list[list[Sample]], on_policy: list[list[Sample]], extra: list[list[Sample]],
        collector: GroupCollector, counters: RolloutCounters, group: dist.ProcessGroup | None,
    ) -> dict[str, float]:
        """The rollout's metrics over trajectories (`on_policy`, `extra`: each its samples, a forked one's segments;
        `algorithms.trajectories`): rewards, accuracy and response lengths (its segments' together) of every on-policy
        one, what filtering kept, the anchor trajectories among the kept groups, the audit verifiers' verdicts on
        every on-policy sample and a multi-turn run's agent/* metrics of every on-policy trajectory (counts summed over
        `group`: collective), the actor's engine's own counters summed over the ranks (`engine_counters`, as
        rollout/*), and what the algorithm's extra sources add (`AnchorSource.metrics`)."""
        metrics = {
            "train/reward_mean": mean([t[0].reward for t in on_policy]),
            "train/accuracy": mean([float(t[0].correct) for t in on_policy]),
            "train/num_gen_batches": float(collector.num_gen_batches),
            "response/length_mean": mean([sum(len(s.response_ids) for s in t) for t in on_policy]),
            "filter/prompts_kept": float(len(groups)),
            "filter/prompts_generated": float(collector.stats.prompts_seen),
            "armor/anchors_used": float(sum(anchor_trajectories(g) for g in groups)),
        }
        if counters.audit is not None:
            metrics.update(counters.audit.from_vector(sum_over_ranks(counters.audit.as_vector(), group)).metrics())
        if counters.agent is not None:
            metrics.update(AgentCounts.from_vector(sum_over_ranks(counters.agent.as_vector(), group)).metrics())
        metrics.update(engine_counters(self.models.actor.engine, group))
        for name in self.plan.algorithm.sources.extra_samples:
            metrics.update(self.extra_sources[name].metrics(groups, extra, counters,
                                                            shared_engine=self.models.shared_engine, group=group))
        return metrics


def trim_to_data_parallel(groups: list[list[Sample]], dp_size: int) -> list[list[Sample]]:
    """The first len(groups) - len(groups) % dp_size groups: a multiple of the data-parallel size, so
    every mini-batch deals at least one group to every rank (`training_batch.local_mini_batch_groups`)."""
    return groups[: len(groups) - len(groups) % dp_size]

