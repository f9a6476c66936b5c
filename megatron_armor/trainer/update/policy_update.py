"""One policy update: mini-batch optimizer steps over a scored batch, with the algorithm's loss."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from megatron.core import parallel_state

from megatron_armor.algorithms import Algorithm, LossInputs
from megatron_armor.algorithms.reduce import aggregation_units
from megatron_armor.config import OptimizerConfig
from megatron_armor.distributed.reduce import from_last_pipeline_stage, sum_over_data_parallel
from megatron_armor.scoring.batch import SequenceBatch
from megatron_armor.scoring.logprobs import (
    LogprobResult, ScoringConfig, TokenScores, forward_backward, gather_scores, masked_scores,
)
from megatron_armor.scoring.micro_batches import MicroBatching
from megatron_armor.scoring.routes import routing_pass
from megatron_armor.diagnostics.subspace import SubspaceConstraint
from megatron_armor.trainer.update.faults import NonFiniteUpdate, find_nonfinite
from megatron_armor.trainer.update.moe_metrics import moe_aux_loss_metrics
from megatron_armor.trainer.update.optimizer import learning_rate, optimizer_step, zero_grads


class PolicyLossCallback:
    """The Megatron loss callback of `algorithm`: (token scores, micro-batch) -> (loss sum, units, stats sums).

    The loss is the micro-batch's partial sum (the algorithm's `policy_loss`, normalizer 1) and `units` its
    count of the aggregation's units (tokens or sequences); Megatron's `finalize_model_grads` divides the
    accumulated gradients by the units summed over micro-batches and data-parallel ranks, so any
    micro-batching and DP/PP layout gives the whole batch's mean. Statistics come back as sums: token means
    times the micro-batch's token count, and the per-unit ones (`per_unit_metrics`: loss/policy_loss and the
    algorithm's `per_unit_stats`, known on every pipeline stage) as partial sums.
    """

    def __init__(self, algorithm: Algorithm) -> None:
        self.algorithm = algorithm
        self.per_unit_metrics = {"loss/policy_loss", *(f"loss/{name}" for name in algorithm.per_unit_stats)}

    def __call__(self, scores: TokenScores, micro_batch: SequenceBatch):
        mask = micro_batch.response_mask  # [b, S]
        on_policy = micro_batch.old_logprobs is None  # the old policy is this forward's (`update_policy`)
        old_logprobs = scores.logprobs.detach() if on_policy else micro_batch.old_logprobs
        terms = self.algorithm.policy_loss(LossInputs(
            logprobs=scores.logprobs, old_logprobs=old_logprobs, ref_logprobs=micro_batch.ref_logprobs,
            engine_logprobs=micro_batch.engine_logprobs, advantages=micro_batch.per_token_advantages(),
            response_mask=mask, is_anchor=micro_batch.is_anchor,
        ))
        num_tokens = mask.sum()
        units = aggregation_units(mask, self.algorithm.loss_aggregation)
        sums = {(name if "/" in name else f"loss/{name}"): value * num_tokens for name, value in terms.token_means.items()}
        sums["loss/policy_loss"] = terms.policy_loss
        sums.update({f"loss/{name}": value for name, value in terms.per_unit.items()})
        sums["num_tokens"] = num_tokens.detach()
        sums["num_units"] = units
        if on_policy:
            sums.update(masked_scores(scores, micro_batch))
        return terms.loss, units.to(torch.int), sums


@dataclass
class UpdateResult:
    """Means of the loss statistics over the whole batch (policy loss and KL over the aggregation's
    units, the rest over tokens), plus optimizer facts. With a `fault` the update stopped at that mini-batch:
    `optimizer_steps` mini-batches before it were applied (the caller undoes them) and `metrics` holds
    only the learning rate."""

    metrics: dict[str, float]
    optimizer_steps: int
    fault: NonFiniteUpdate | None = None
    old_scores: LogprobResult | None = None  # an on-policy mini-batch's logprobs and entropy (rows of it)


def update_policy(
    ddp, optimizer, mini_batches: list[SequenceBatch], *, micro_batching: MicroBatching, algorithm: Algorithm,
    scoring: ScoringConfig, optim: OptimizerConfig, rl_step: int, constraint: SubspaceConstraint | None = None,
    warmup_from: int = 0,
) -> UpdateResult:
    """One optimizer step per mini-batch (ppo_epochs = 1), all at RL step `rl_step`'s learning rate, its warmup
    counted from RL step `warmup_from` (the monitor's anchor action restarts it).

    Returns loss statistics averaged over the whole step (all data-parallel ranks), on every rank. A
    mini-batch whose loss or gradients are not finite on any rank is never stepped: its gradients are
    discarded and the update stops there on every rank (`UpdateResult.fault`).
    A single mini-batch without old_logprobs is exactly on-policy (`StepPlan.old_logprobs_from_update`): its
    forward's detached logprobs are the old policy's, and they come back with its entropy in `old_scores` (and a
    MoE actor's routing metrics in `metrics`). A mini-batch with `routed_experts` replays them (R3, R2).
    """
    on_policy = [mini_batch.old_logprobs is None for mini_batch in mini_batches]
    if any(on_policy) and len(mini_batches) > 1:
        raise ValueError("old-policy logprobs come from the update's forward only with one mini-batch per RL step; "
                         f"got {len(mini_batches)} mini-batches, {sum(on_policy)} of them without old_logprobs")
    loss_fn = PolicyLossCallback(algorithm)
    lr = learning_rate(rl_step - warmup_from, optim)
    totals: dict[str, float] = {}
    grad_norms, old_scores, routing_metrics, micro_batch_count = [], None, {}, 0
    for index, mini_batch in enumerate(mini_batches):
        micro_batches = micro_batching.split(mini_batch)
        micro_batch_count += len(micro_batches)
        pass_scoring = dataclasses.replace(scoring, with_entropy=True) if on_policy[index] else scoring
        routing = routing_pass(ddp, mini_batch)
        outputs = forward_backward(ddp, micro_batches, loss_fn, scoring=pass_scoring, forward_only=False,
                                   routing=routing)
        scores = [{k: out.pop(k) for k in list(out) if k.startswith("scores/")} for out in outputs]
        if on_policy[index]:
            old_scores = gather_scores(scores, micro_batches, mini_batch, with_entropy=True)
            routing_metrics = {} if routing is None else routing.metrics()
        fault = find_nonfinite(ddp, outputs, rl_step=rl_step, mini_batch=index)
        if fault is not None:
            zero_grads(ddp, optimizer)
            return UpdateResult(metrics={"optim/lr": lr}, optimizer_steps=index, fault=fault, old_scores=old_scores)
        for out in outputs:
            for name, value in out.items():
                totals[name] = totals.get(name, 0.0) + float(value)
        step = optimizer_step(ddp, optimizer, lr, constraint)
        if not step.updated:  # every rank's norm is finite (find_nonfinite), their sum over model-parallel ranks not
            raise FloatingPointError(f"RL step {rl_step}, mini-batch {index}: non-finite gradient norm {step.grad_norm}")
        grad_norms.append(step.grad_norm)
    if parallel_state.is_pipeline_last_stage():
        totals = sum_over_data_parallel(totals)
    totals = from_last_pipeline_stage(totals)
    tokens = max(totals.pop("num_tokens", 0.0), 1.0)
    units = max(totals.pop("num_units", 0.0), 1.0)
    metrics = {name: value / (units if name in loss_fn.per_unit_metrics else tokens) for name, value in totals.items()}
    metrics["optim/grad_norm"] = sum(grad_norms) / len(grad_norms)
    metrics["optim/lr"] = lr
    metrics.update(moe_aux_loss_metrics(ddp.module.config, micro_batch_count))
    metrics.update(routing_metrics)
    return UpdateResult(metrics=metrics, optimizer_steps=len(mini_batches), old_scores=old_scores)
