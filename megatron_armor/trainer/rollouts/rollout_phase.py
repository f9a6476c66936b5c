"""The rollout phase of an RL step: generate and score samples, group them, until the batch is full.

Generation batches of prompts are sampled from the rollout sources the algorithm asks for (`Algorithm.sources`: the
policy that samples the training responses, and the extra sources whose samples join the groups, ARMOR's anchors:
trainer/rollouts/anchors.py, behind the protocol of trainer/rollouts/extra_sources.py), scored
(`samples.generate_samples`) and grouped (`algorithms.build_groups`), one `GenerationBatch` at a time, until
`train_batch_size` prompts survive filtering (ARMOR §1); `assemble` turns the batches into the step's `Rollout`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from megatron_armor.agentic.metrics import AgentCounts
from megatron_armor.algorithms import (
    ACTOR, GroupCollector, GroupStats, anchor_trajectories, build_groups, trajectories,
)
from megatron_armor.data.datasets import PromptRow, PromptSampler
from megatron_armor.data.types import Sample
from megatron_armor.distributed.reduce import sum_over_ranks
from megatron_armor.rollout.base import SamplingParams
from megatron_armor.trainer.colocation.engine_weights import EngineWeights
from megatron_armor.trainer.rollouts.extra_sources import DrawnBatch, ExtraSampleSource
from megatron_armor.trainer.rollouts.samples import (
    RolloutCounters, SampleScorer, draw_prompts, engine_counters, generate_samples, mean,
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

    Holds no state of its own: the prompt position is the `sampler`'s, what the engines hold the policies'
    (`Policy.holds_weights`, kept by `engine_weights`), and what its `extra_sources` cache or sample ahead theirs.
    Its collectives run over `group` (default: the default group; background rollouts,
    trainer/rollouts/rollout_schedule.py, have one of their own).
    """

    def __init__(
        self, plan: StepPlan, models: PolicyHandles, sources: RolloutSources, engine_weights: EngineWeights,
        extra_sources: Sequence[ExtraSampleSource], dp_size: int, group: dist.ProcessGroup | None = None,
    ) -> None:
        self.plan, self.models = plan, models
        self.sampler, self.sampling, self.scorer = sources.sampler, sources.sampling, sources.scorer
        self.engine_weights, self.dp_size = engine_weights, dp_size
        self.extra_sources = {source.name: source for source in extra_sources}  # what an algorithm may name
        self.group = group

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
        group): the training responses from the algorithm's sampler, seeded from train.seed and `key`, and the
        samples of its extra sources (ARMOR's anchors), each taken before or after the training responses as its
        source decides when the batch opens it (`ExtraSampleSource.open`). `on_actor_done()` is called once the
        training responses are drawn (the sampler's engine is done with the batch)."""
        plan = self.plan  # the anchor action may switch it while the batch waits for its anchors
        counters = RolloutCounters(audit=self.scorer.audits.new_counts() if self.scorer.audits.names else None,
                                   agent=AgentCounts() if self.scorer.rolls_out_trajectories else None)
        position = self.sampler.state_dict()
        prompts = draw_prompts(self.sampler)
        drawn = DrawnBatch(prompts, position, self.sampler, counters, self.group,
                           self.models.policy(plan.algorithm.sources.sampler))
        opened = [self.extra_sources[name].open(drawn) for name in plan.algorithm.sources.extra_samples]
        early = [samples.take() if samples.before_on_policy else None for samples in opened]
        on_policy = self.sample_on_policy(prompts, self.seed(key), counters)
        if on_actor_done is not None:
            on_actor_done()
        extra = [s for samples, taken in zip(opened, early) for s in (samples.take() if taken is None else taken)]
        groups, stats = build_groups(on_policy + extra, require_anchor=bool(opened),
                                     filter_groups=plan.algorithm.filters_groups)
        return GenerationBatch(groups, stats, on_policy, extra, counters)

    def sample_ahead(self, group: dist.ProcessGroup | None, depth: int) -> None:
        """Let the extra sources sample ahead of the generation batches that use them, on a thread whose collectives
        run over `group` (a process group of its own), up to `depth` batches beyond the one in use (the overlapped
        rollout modes)."""
        for source in self.extra_sources.values():
            source.sample_ahead(group, depth)

    def drain_ahead(self) -> None:
        """Wait until what the extra sources sample ahead is sampled (the run's end, before a checkpoint)."""
        for source in self.extra_sources.values():
            source.drain_ahead()

    def drop_ahead(self) -> None:
        """Drop what the extra sources sampled ahead, once sampled (a reference reset, the anchor action)."""
        for source in self.extra_sources.values():
            source.drop_ahead()

    def seed(self, key: tuple) -> tuple:
        """The sampling seed of the training responses of generation batch `key`."""
        return (self.plan.train.seed, *key, ACTOR)

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
        sources = self.plan.algorithm.sources
        for name in sources.extra_samples:
            metrics.update(self.extra_sources[name].metrics(groups, extra, counters,
                                                            policy=self.models.policy(sources.sampler), group=group))
        return metrics


def trim_to_data_parallel(groups: list[list[Sample]], dp_size: int) -> list[list[Sample]]:
    """The first len(groups) - len(groups) % dp_size groups: a multiple of the data-parallel size, so
    every mini-batch deals at least one group to every rank (`training_batch.local_mini_batch_groups`)."""
    return groups[: len(groups) - len(groups) % dp_size]

