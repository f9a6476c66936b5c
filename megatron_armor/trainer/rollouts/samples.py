"""Generate and score rollouts for a batch of prompts, split over all ranks.

Every rank holds rollout engines (in-process on CPU; SGLang clients on GPU clusters). The sample
requests of a generation batch are dealt round-robin over ranks, generated, scored locally, then
all-gathered as packed tensors (`distributed/sample_exchange.py`) so that every rank sees the same ordered
list of `Sample`s.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import torch.distributed as dist

from megatron_armor.agentic.metrics import AgentCounts
from megatron_armor.agentic.trajectory import Trajectory
from megatron_armor.config import RewardConfig
from megatron_armor.data.datasets import PromptRow, PromptSampler
from megatron_armor.data.types import Sample
from megatron_armor.distributed.reduce import sum_over_ranks
from megatron_armor.distributed.sample_exchange import all_gather_samples
from megatron_armor.rewards.audit import AuditCounts, AuditVerifiers
from megatron_armor.rewards.overlong import overlong_penalty
from megatron_armor.rewards.registry import score
from megatron_armor.rollout.base import RolloutEngine, SamplingParams
from megatron_armor.rollout.weight_sync import SyncReport
from megatron_armor.utils.seeding import stable_seed

RewardFn = Callable[[str, dict], tuple[float, bool]]
T = TypeVar("T")


class SampleScorer:
    """Turns engine generations into scored `Sample`s (decode, verify, overlong penalty); with `audits`, also
    judges them by the audit verifiers (`audit`), which never change a sample's reward. `respond` samples one
    completion per prompt; a multi-turn run's scorer samples a trajectory instead (trainer/rollouts/trajectories.py).

    With `reward` (the reward section) a response of L tokens also gets DAPO's soft overlong penalty
    (rewards/overlong.py) for responses of at most `max_response_length` tokens (rollout.sampling.max_new_tokens):
    the section's `overlong_buffer_for(max_response_length)` and `overlong_factor`; without it (validation, the
    MIPU gate), none.
    """

    rolls_out_trajectories: ClassVar[bool] = False  # whether `respond` counts trajectories into its `agent` counts
    # whether `generate_samples` seeds its requests one by one (`SamplingParams.seeds`) rather than by rank
    seeds_each_request: ClassVar[bool] = False

    def __init__(
        self, tokenizer, reward_fn: RewardFn, reward: RewardConfig | None = None, *, max_response_length: int = 0,
        audits: AuditVerifiers = AuditVerifiers(),
    ) -> None:
        if reward is not None and max_response_length < 1:
            raise ValueError(f"the overlong penalty needs max_response_length >= 1, got {max_response_length}")
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.reward, self.max_response_length = reward, max_response_length
        self.audits = audits

    def respond(self, engine: RolloutEngine, prompts: Sequence[PromptRow], sampling: SamplingParams, *,
                is_anchor: bool, agent: AgentCounts | None = None) -> list[list[Sample]]:
        """The answer of each of `prompts` from `engine`, in order, as its samples: here one scored completion (a
        trajectory scorer's answer is a trajectory's segments, several when it forked); samples keep the engine's
        routed experts unless they are anchors (the reference's weights routed them). `agent`: the counts of
        trajectories (none here)."""
        generations = engine.generate([p.prompt_ids for p in prompts], sampling) if prompts else []
        return [
            [self(p, g.response_ids, g.logprobs, g.finish_reason, is_anchor=is_anchor,
                  routed_experts=None if is_anchor else g.routed_experts,  # the actor routes anchors itself
                  token_versions=g.versions)]
            for p, g in zip(prompts, generations)
        ]

    def respond_with_trajectories(self, engine: RolloutEngine, prompts: Sequence[PromptRow], sampling: SamplingParams,
                                  *, is_anchor: bool, agent: AgentCounts | None = None,
                                  ) -> list[tuple[list[Sample], Trajectory | None]]:
        """`respond`'s answers, each beside the trajectory it is made of (what evaluation records of it): None here,
        single completions."""
        return [(answer, None) for answer in self.respond(engine, prompts, sampling, is_anchor=is_anchor, agent=agent)]

    def audit(self, prompt: PromptRow, sample: Sample) -> tuple[bool, ...]:
        """Each audit verifier's `correct` for `sample`, a response to `prompt` (() without audits)."""
        if not self.audits.names:
            return ()
        return self.audits.verdicts(self.response_text(sample.response_ids, sample.finish_reason), prompt.row)

    def response_text(self, response_ids: Sequence[int], finish_reason: str) -> str:
        """Decoded response without its stop token."""
        ids = list(response_ids[:-1] if finish_reason == "stop" else response_ids)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def __call__(self, prompt: PromptRow, response_ids, logprobs, finish_reason: str, *, is_anchor: bool,
                 routed_experts=None, token_versions=None) -> Sample:
        reward, correct = score(self.reward_fn, self.response_text(response_ids, finish_reason), prompt.row)
        if self.reward is not None:
            buffer = self.reward.overlong_buffer_for(self.max_response_length)
            if buffer > 0:
                reward += overlong_penalty(len(response_ids), self.max_response_length, buffer,
                                           self.reward.overlong_factor)
        return Sample(
            prompt_index=prompt.index,
            prompt_ids=list(prompt.prompt_ids),
            response_ids=list(response_ids),
            engine_logprobs=list(logprobs),
            finish_reason=finish_reason,
            is_anchor=is_anchor,
            reward=float(reward),
            correct=bool(correct),
            routed_experts=routed_experts,
            token_versions=None if token_versions is None else list(token_versions),
        )


@dataclass
class RolloutCounters:
    """What one step's rollout spent on anchors and on swapping weights in a shared engine (seconds, counts)."""

    anchor_seconds: float = 0.0  # anchor phases, ref pushes included (overlapped modes: the wait for their anchors)
    ref_push_seconds: float = 0.0
    actor_restore_seconds: float = 0.0  # actor pushes back into a shared engine after an anchor phase
    weight_swaps: int = 0  # pushes into a shared engine
    anchor_cache_hits: int = 0  # prompts whose anchors came from the cache
    audit: AuditCounts | None = None  # audit verdicts on the on-policy samples this rank scored (with audits)
    agent: AgentCounts | None = None  # the on-policy trajectories this rank rolled out (multi-turn runs)

    def add_push(self, report: SyncReport | None, *, anchors: bool) -> None:
        """Count a push into a shared engine (None: none was needed): of the reference's weights for the `anchors`,
        else of the actor's back for its samples."""
        if report is None:
            return
        self.weight_swaps += 1
        if anchors:
            self.ref_push_seconds += report.seconds
        else:
            self.actor_restore_seconds += report.seconds

    @classmethod
    def merged(cls, parts: Sequence[RolloutCounters]) -> RolloutCounters:
        """The sums of `parts` (e.g. of a step's generation batches; their audit counts too, when they have them)."""
        total = cls()
        for name in (f.name for f in dataclasses.fields(cls) if f.name not in ("audit", "agent")):
            setattr(total, name, sum(getattr(part, name) for part in parts))
        audits = [part.audit for part in parts if part.audit is not None]
        if audits:
            total.audit = audits[0].from_vector([sum(v) for v in zip(*(a.as_vector() for a in audits), strict=True)])
        agents = [part.agent for part in parts if part.agent is not None]
        if agents:
            total.agent = functools.reduce(AgentCounts.merged, agents)
        return total


@dataclass(frozen=True)
class RequestShare:
    """The requests (prompt p, sample k) of a batch, prompt-major, dealt round-robin over the `world` ranks of a
    group: rank r answers `requests[r::world]` (`mine` on rank `rank`)."""

    requests: list[tuple[int, int]]
    rank: int
    world: int

    @classmethod
    def deal(cls, prompts: int, samples_per_prompt: int, group: dist.ProcessGroup | None = None) -> RequestShare:
        """The share of this rank of `group` (the default group; all of it without torch.distributed)."""
        rank, world = (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)
        return cls([(p, k) for p in range(prompts) for k in range(samples_per_prompt)], rank, world)

    @property
    def mine(self) -> list[tuple[int, int]]:
        return self.requests[self.rank::self.world]

    @property
    def mine_numbers(self) -> range:
        """The numbers of `mine`: their places in `requests`."""
        return range(self.rank, len(self.requests), self.world)

    def in_request_order(self, answers: Sequence[T]) -> list[T]:
        """Every rank's answers to its share, concatenated in rank order (as gathered), put in request order."""
        answered = [request for r in range(self.world) for request in self.requests[r::self.world]]
        return [answer for _, answer in sorted(zip(answered, answers, strict=True), key=lambda item: item[0])]


def generate_samples(
    engine: RolloutEngine,
    prompts: Sequence[PromptRow],
    samples_per_prompt: int,
    sampling: SamplingParams,
    scorer: SampleScorer,
    *,
    is_anchor: bool,
    seed: int,
    audit: AuditCounts | None = None,
    agent: AgentCounts | None = None,
    group: dist.ProcessGroup | None = None,
) -> list[Sample]:
    """`samples_per_prompt` scored samples of every prompt, ordered by prompt then sample index.

    A collective over `group` (default: the default process group) when torch.distributed is initialised (the
    background rollouts of rollout.mode one_step_off and async use a group of their own): each rank generates its
    round-robin share of the requests (`RequestShare`) with a rank-specific seed derived from `seed`, or, when the
    scorer seeds each request (`SampleScorer.seeds_each_request`: every trajectory scorer), each request (prompt p,
    sample k) with its own, stable_seed(seed, p's index, k): its samples are then the same at any number of ranks
    (training's single completions keep the rank seeds; evaluation seeds each request itself:
    trainer/step/validation.py). Each request is answered as the scorer responds (`SampleScorer.respond`: a
    completion, or a multi-turn trajectory: its segments, several when it forked), each sample numbered by its
    request (`Sample.trajectory`: its place in the prompt-major requests), which orders the gathered samples. With
    `audit`, the scorer's audit verdicts on this rank's share are counted into it before the samples are gathered
    (sum the counts over ranks for the whole batch's; a trajectory's by its last segment, which holds its final
    answer); with `agent`, the share's trajectories (multi-turn runs).
    """
    share = RequestShare.deal(len(prompts), samples_per_prompt, group)
    mine = share.mine
    if scorer.seeds_each_request:
        local_sampling = dataclasses.replace(
            sampling, seeds=tuple(stable_seed(seed, prompts[p].index, k) for p, k in mine))
    else:
        local_sampling = dataclasses.replace(sampling, seed=stable_seed(seed, share.rank))
    answers = scorer.respond(engine, [prompts[p] for p, _ in mine], local_sampling, is_anchor=is_anchor, agent=agent)
    if audit is not None:
        for (p, _), answer in zip(mine, answers):
            audit.add(answer[-1].correct, scorer.audit(prompts[p], answer[-1]))
    samples = [dataclasses.replace(sample, trajectory=number)
               for number, answer in zip(share.mine_numbers, answers, strict=True) for sample in answer]
    if share.world == 1:
        return samples
    return sorted(all_gather_samples(samples, group), key=lambda sample: sample.trajectory)  # stable: segments in order


def draw_prompts(sampler: PromptSampler) -> list[PromptRow]:
    """`sampler`'s next batch of prompts, each indexed by its place in the batch: a generation batch's prompts."""
    return [dataclasses.replace(p, index=i) for i, p in enumerate(sampler.next_batch())]


def engine_counters(engine: RolloutEngine, group: dist.ProcessGroup | None) -> dict[str, float]:
    """The engine's cumulative counters (`RolloutEngine.metrics`, e.g. rollout/retries) summed over the ranks of
    `group` (collective when it has any): every rank is a client of its own that sends its share of the requests,
    so one rank's counts would miss the others' (a retry on rank 1 only, say)."""
    counters = engine.metrics()
    if not counters:
        return {}
    totals = sum_over_ranks([round(value) for value in counters.values()], group)
    return {name: float(total) for name, total in zip(counters, totals, strict=True)}


def mean(values) -> float:
    """The mean of `values`, 0.0 when there are none."""
    values = list(values)
    return float(sum(values) / len(values)) if values else 0.0
