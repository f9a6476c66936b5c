"""From kept groups to a rank's training batch: the advantage phase and the logprob phase of an RL step.

    groups --advantage_batch--> AdvantageBatch --score_logprobs--> PreparedBatch --batch_metrics--> metrics

Both phases see only this data-parallel rank's share of each mini-batch (`local_mini_batch_groups`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_armor.algorithms import (
    ACTOR, ANCHORS, REFERENCE, TEACHER, StepSources, mismatch_k3, mix_kl_metrics, reverse_kl, trajectory_advantages,
)
from megatron_armor.algorithms.reduce import masked_mean
from megatron_armor.data.types import Sample
from megatron_armor.distributed.reduce import mean_over_data_parallel
from megatron_armor.scoring.batch import SequenceBatch, build_sequence_batch
from megatron_armor.scoring.logprobs import LogprobResult, ScoringConfig, compute_logprobs
from megatron_armor.scoring.routes import routing_pass
from megatron_armor.trainer.step_inputs.plan import StepPlan
from megatron_armor.trainer.step_inputs.policies import PolicyHandles
from megatron_armor.utils.seeding import stable_seed

SCORE_FIELDS = {REFERENCE: "ref_logprobs", TEACHER: "teacher_logprobs"}  # `SequenceBatch` field of a policy's scores


@dataclass
class AdvantageBatch:
    """A rank's samples of the step, packed, with their group advantages (no logprobs yet).

    batch: `SequenceBatch` of B rows, this rank's share of the first mini-batch, then of the second, ...;
           advantages [B] float32 set, old/ref/teacher logprobs None;
    mini_batch_sizes: rows of each mini-batch in `batch`, in order (they sum to B);
    num_tokens: prompt + response tokens of the whole step (all data-parallel ranks).
    """

    batch: SequenceBatch
    mini_batch_sizes: list[int]
    num_tokens: int


@dataclass
class PreparedBatch:
    """A rank's training batch for one step: the whole local batch and its mini-batch views.

    batch: the `AdvantageBatch`'s, with old_logprobs [B, S] float32 and, as the plan needs them,
           ref_logprobs [B, S] float32, teacher_logprobs and token_advantages [B, S] float32 (OPD);
    mini_batches: row slices of `batch`, one per optimizer step;
    old_entropy: [B, S] float32 policy entropy before the update (0 off the response);
    num_tokens: prompt + response tokens of the whole step (all data-parallel ranks);
    routing_metrics: a MoE actor's `moe/*` routing metrics of the old-logprob pass (`scoring/routes.py`).
    With `StepPlan.old_logprobs_from_update` old_logprobs and old_entropy are None until the update's forward
    gives them (`record_old_scores`), and the update reports the routing metrics.
    """

    batch: SequenceBatch
    mini_batches: list[SequenceBatch]
    old_entropy: torch.Tensor | None
    num_tokens: int
    routing_metrics: dict[str, float] = dataclasses.field(default_factory=dict)

    def record_old_scores(self, scores: LogprobResult) -> None:
        """Keep the old-policy logprobs and entropy the on-policy update's forward gave ([B, S] rows of `batch`)."""
        self.batch.old_logprobs, self.old_entropy = scores.logprobs, scores.entropy


def advantage_batch(
    groups: list[list[Sample]], plan: StepPlan, *, dp_size: int, dp_rank: int, pad_token_id: int
) -> AdvantageBatch:
    """Group advantages A = (R - b_g) / (std_g + eps) of every sample of the step (anchors included; over
    trajectories: the segments of a forked one share its advantage, `trajectory_advantages`), and this rank's share
    of each mini-batch packed into one batch (a group's samples, segments included, stay together)."""
    samples = [s for g in groups for s in g]
    group_ids = [gi for gi, g in enumerate(groups) for _ in g]
    section = plan.algorithm_section
    advantages = trajectory_advantages(samples, group_ids, eps=section.adv_eps, baseline=section.advantage_baseline,
                                       quantile=section.baseline_quantile)
    group_start = [0]
    for g in groups:
        group_start.append(group_start[-1] + len(g))
    group_tokens = [sum(len(s.prompt_ids) + len(s.response_ids) for s in g) for g in groups]
    rows = [  # sample rows of each local mini-batch
        [r for gi in local for r in range(group_start[gi], group_start[gi + 1])]
        for local in local_mini_batch_groups(group_tokens, plan.train.mini_batch_size, dp_size, dp_rank)
    ]
    order = [r for mini in rows for r in mini]
    if plan.routing_replay.engines_record and any(s.routed_experts is None for s in samples if not s.is_anchor):
        raise ValueError("train.routing_replay rollout replays the engine's routing, but on-policy samples carry no "
                         "routed_experts: the actor must be a MoE model sampled by its own engine (not the OPD "
                         "teacher's), and SGLang servers need --enable-return-routed-experts")
    batch = build_sequence_batch([samples[r] for r in order], advantages[order].tolist(), pad_token_id=pad_token_id)
    return AdvantageBatch(
        batch=batch,
        mini_batch_sizes=[len(mini) for mini in rows],
        num_tokens=sum(len(s.prompt_ids) + len(s.response_ids) for s in samples),
    )


def score_logprobs(
    advantaged: AdvantageBatch, models: PolicyHandles, plan: StepPlan, scoring: ScoringConfig, *,
    optimizer_steps: int, dp_rank: int,
) -> PreparedBatch:
    """The actor's logprobs and entropy before the update (unless the update gives them:
    `StepPlan.old_logprobs_from_update`), and what the algorithm asks for: the logprobs of the policies it is scored
    by (`StepSources.scores`: the reference's, the teacher's; into their `SCORE_FIELDS`), and per-token advantages
    from the scored batch (its random draws: one stream per optimizer-step count and data shard). A MoE actor's
    old-logprob pass replays the batch's routes (R3) and reports its routing metrics; under R2 its routers' choices
    become the routes the update replays. Collective over the model-parallel group; fills in `advantaged.batch` in
    place."""
    batch, algorithm = advantaged.batch, plan.algorithm
    old_entropy, routing_metrics = None, {}
    if not plan.old_logprobs_from_update:
        routing = routing_pass(models.actor.model, batch)
        old = compute_logprobs(models.actor.model, batch, micro_batching=plan.micro_batching,
                               scoring=dataclasses.replace(scoring, with_entropy=True), routing=routing)
        batch.old_logprobs, old_entropy = old.logprobs, old.entropy
        if routing is not None:
            routing_metrics = routing.metrics()
            if plan.routing_replay.update_replays_old_pass:
                batch.routed_experts = routing.chosen
    for name in algorithm.sources.scores:
        scores = models.policy(name).score(batch, micro_batching=plan.micro_batching, scoring=scoring)
        setattr(batch, SCORE_FIELDS[name], scores)
    generator = torch.Generator().manual_seed(stable_seed(plan.train.seed, optimizer_steps, algorithm.name, dp_rank))
    batch.token_advantages = algorithm.token_advantages(
        batch.old_logprobs, batch.teacher_logprobs, batch.response_mask, batch.advantages, generator
    )
    bounds = [0]
    for size in advantaged.mini_batch_sizes:
        bounds.append(bounds[-1] + size)
    return PreparedBatch(
        batch=batch,
        mini_batches=[batch.select(slice(a, b)) for a, b in zip(bounds[:-1], bounds[1:])],
        old_entropy=old_entropy,
        num_tokens=advantaged.num_tokens,
        routing_metrics=routing_metrics,
    )


def batch_metrics(prepared: PreparedBatch, sources: StepSources) -> dict[str, float]:
    """Metrics of a prepared batch of an algorithm with `sources`, before the update: entropy, train/rollout mismatch
    (mean |diff| and Mismatch-K3 on on-policy tokens; none unless the actor's engine sampled the batch, not the OPD
    teacher's), mix KL (with the anchors' terms when the algorithm has anchors), OPD reverse KL.

    Each is computed on the rank's data-parallel shard and averaged over data-parallel ranks (collective); the
    routing metrics of the old-logprob pass (already over all ranks) join them.
    """
    batch = prepared.batch
    metrics = {"policy/entropy": float(masked_mean(prepared.old_entropy, batch.response_mask))}
    if sources.sampler == ACTOR:  # engine_logprobs are the actor engine's
        on_policy = ~batch.is_anchor
        diff = (batch.old_logprobs - batch.engine_logprobs).abs() * batch.response_mask
        per_sample = diff.sum(1) / batch.response_mask.sum(1).clamp(min=1)
        on_policy_mask = batch.response_mask * on_policy[:, None]
        metrics["mismatch/logprob_abs_diff"] = float(per_sample[on_policy].mean()) if on_policy.any() else 0.0
        metrics["mismatch/k3"] = float(mismatch_k3(batch.old_logprobs, batch.engine_logprobs, on_policy_mask))
    if batch.ref_logprobs is not None:  # keys from the plan, not the shard: the same on every rank
        metrics.update(mix_kl_metrics(batch.old_logprobs, batch.ref_logprobs, batch.is_anchor, batch.response_mask,
                                      with_anchors=ANCHORS in sources.extra_samples))
    if batch.teacher_logprobs is not None:
        metrics["opd/reverse_kl"] = float(reverse_kl(batch.old_logprobs, batch.teacher_logprobs, batch.response_mask))
    return {**mean_over_data_parallel(metrics), **prepared.routing_metrics}


def local_mini_batch_groups(
    group_tokens: Sequence[int], mini_batch_size: int, dp_size: int, dp_rank: int
) -> list[list[int]]:
    """Group indices (ascending) of rank `dp_rank`'s share of each mini-batch, for groups of `group_tokens`
    prompt + response tokens: each mini-batch's groups are dealt to the ranks in equal numbers, balancing their
    token totals (`balanced_deal`, as verl's balance_batch), so no rank waits for a rank with the long tail.

    Both counts must be multiples of dp_size (config validation, `rollout_phase.trim_to_data_parallel`): then
    no share is empty and every rank gets ceil(num_groups / mini_batch_size) mini-batches, i.e. runs the
    same optimizer steps (and collectives).
    """
    num_groups = len(group_tokens)
    if num_groups % dp_size or mini_batch_size % dp_size:
        raise ValueError(f"{num_groups} groups in mini-batches of {mini_batch_size} cannot be dealt evenly to "
                         f"{dp_size} data-parallel ranks (both must be multiples of it)")
    shares = []
    for start in range(0, num_groups, mini_batch_size):
        mini_batch = range(start, min(start + mini_batch_size, num_groups))
        shares.append(balanced_deal(mini_batch, group_tokens, dp_size)[dp_rank])
    return shares


def balanced_deal(items: Sequence[int], weights: Sequence[int], parts: int) -> list[list[int]]:
    """`items` (a multiple of `parts` of them) dealt into `parts` lists of equal length with near-equal total
    `weights[item]`: heaviest first, each to the lightest list that still has room (ties: the lower list, the
    lower item). Deterministic, so every rank computes the same deal. Each list ascending."""
    per_part = len(items) // parts
    totals, dealt = [0] * parts, [[] for _ in range(parts)]
    for item in sorted(items, key=lambda i: (-weights[i], i)):
        part = min((p for p in range(parts) if len(dealt[p]) < per_part), key=lambda p: (totals[p], p))
        dealt[part].append(item)
        totals[part] += weights[item]
    return [sorted(part) for part in dealt]
