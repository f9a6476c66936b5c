"""One policy update: mini-batch optimizer steps over a scored batch, with the configured loss."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from megatron.core import parallel_state

from megatron_armor.algorithms import armor_policy_loss, kl_penalty, sampler_corrected_loss
from megatron_armor.algorithms.reduce import LossAggregation, aggregate_loss, aggregation_units, check_aggregation
from megatron_armor.distributed.reduce import from_last_pipeline_stage, sum_over_data_parallel
from megatron_armor.scoring.batch import SequenceBatch
from megatron_armor.scoring.logprobs import ScoringSettings, TokenScores, forward_backward
from megatron_armor.diagnostics.subspace import SubspaceConstraint
from megatron_armor.trainer.optimizer import OptimizerSettings, learning_rate, optimizer_step


@dataclass(frozen=True)
class SamplerCorrection:
    """MIPU Step 1: weight each token's loss by pi_old/mu (engine) corrected as `mode` ("tis" | "mis" | "none")."""

    mode: str = "tis"
    w_max: float = 2.0


@dataclass(frozen=True)
class LossSettings:
    """Policy-loss knobs. alpha = 1 gives DAPO dual-clip PPO; kl_coef > 0 adds a KL-to-reference term;
    `sampler` set gives the MIPU sampler-referenced loss (alpha and the reference are then unused).
    `aggregation` ("token_mean" | "seq_mean_token_mean", algorithms/reduce.py) reduces the policy
    loss and the KL term alike."""

    alpha: float = 0.9375
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float = 10.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    temperature: float = 1.0
    logprob_head: str = "torch"  # "torch" | "fused" (scoring/logprobs.py)
    sampler: SamplerCorrection | None = None
    aggregation: LossAggregation = "token_mean"

    def __post_init__(self) -> None:
        check_aggregation(self.aggregation)

    def scoring(self, *, with_entropy: bool = False) -> ScoringSettings:
        return ScoringSettings(temperature=self.temperature, head=self.logprob_head, with_entropy=with_entropy)


# Metrics averaged over the aggregation's units (tokens or sequences); every other statistic is a token mean.
PER_UNIT_METRICS = ("loss/policy_loss", "loss/kl_to_ref")


def policy_loss_fn(settings: LossSettings) -> Callable:
    """The Megatron loss callback: (token scores, micro-batch) -> (loss sum, units, stats sums).

    The loss is the micro-batch's partial sum (`aggregate_loss` with normalizer 1) and `units` its
    count of the aggregation's units (tokens or sequences); Megatron's `finalize_model_grads`
    divides the accumulated gradients by the units summed over micro-batches and data-parallel
    ranks, so any micro-batching and DP/PP layout gives the whole batch's mean.
    """
    aggregation = settings.aggregation

    def loss_fn(scores: TokenScores, mb: SequenceBatch):
        logp = scores.logprobs  # [b, S]
        mask = mb.response_mask
        advantages = mb.per_token_advantages()
        reduction = dict(aggregation=aggregation, normalizer=1.0)  # partial sums: Megatron divides by all units
        clip = dict(clip_low=settings.clip_low, clip_high=settings.clip_high, dual_clip=settings.dual_clip)
        if settings.sampler is not None:
            loss, stats = sampler_corrected_loss(
                logp, mb.old_logprobs, mb.engine_logprobs, advantages, mask, correction=settings.sampler.mode,
                w_max=settings.sampler.w_max, **reduction, **clip,
            )
        else:
            loss, stats = armor_policy_loss(
                logp, mb.old_logprobs, mb.ref_logprobs, advantages, mask, alpha=settings.alpha, **reduction, **clip,
            )
        num_tokens = mask.sum()
        units = aggregation_units(mask, aggregation)
        sums = {f"loss/{name}": value * num_tokens for name, value in stats.items() if name != "num_tokens"}
        sums["loss/policy_loss"] = loss.detach()
        if settings.kl_coef > 0:
            kl = aggregate_loss(kl_penalty(logp, mb.ref_logprobs, settings.kl_estimator), mask, **reduction)
            loss = loss + settings.kl_coef * kl
            sums["loss/kl_to_ref"] = kl.detach()
        sums["num_tokens"] = num_tokens.detach()
        sums["num_units"] = units
        return loss, units.to(torch.int), sums

    return loss_fn


@dataclass
class UpdateResult:
    """Means of the loss statistics over the whole batch (policy loss and KL over the aggregation's
    units, the rest over tokens), plus optimizer facts."""

    metrics: dict[str, float]
    optimizer_steps: int


def update_policy(
    ddp, optimizer, mini_batches: list[SequenceBatch], *, micro_batch_size: int, loss: LossSettings,
    optim: OptimizerSettings, rl_step: int, constraint: SubspaceConstraint | None = None,
) -> UpdateResult:
    """One optimizer step per mini-batch (ppo_epochs = 1), all at RL step `rl_step`'s learning rate.

    Returns loss statistics averaged over the whole step (all data-parallel ranks), on every rank.
    """
    loss_fn = policy_loss_fn(loss)
    lr = learning_rate(rl_step, optim)
    totals: dict[str, float] = {}
    grad_norms = []
    for index, mini_batch in enumerate(mini_batches):
        outputs = forward_backward(
            ddp, list(mini_batch.micro_batches(micro_batch_size)), loss_fn, scoring=loss.scoring(), forward_only=False
        )
        for out in outputs:
            for name, value in out.items():
                totals[name] = totals.get(name, 0.0) + float(value)
        step = optimizer_step(ddp, optimizer, lr, constraint)
        if not step.updated:
            raise FloatingPointError(f"RL step {rl_step}, mini-batch {index}: non-finite gradient norm {step.grad_norm}")
        grad_norms.append(step.grad_norm)
    if parallel_state.is_pipeline_last_stage():
        totals = sum_over_data_parallel(totals)
    totals = from_last_pipeline_stage(totals)
    tokens = max(totals.pop("num_tokens", 0.0), 1.0)
    units = max(totals.pop("num_units", 0.0), 1.0)
    metrics = {name: value / (units if name in PER_UNIT_METRICS else tokens) for name, value in totals.items()}
    metrics["optim/grad_norm"] = sum(grad_norms) / len(grad_norms)
    metrics["optim/lr"] = lr
    return UpdateResult(metrics=metrics, optimizer_steps=len(mini_batches))
