"""MIPU (mipu.md): the registered algorithm, and Step 2's math: the post-update inference-gap proxy, its
tolerance schedule and the accept rule (§3). Step 1's sampler-corrected loss is in importance.py."""

from __future__ import annotations

import math

import torch

from megatron_armor.algorithms.base import Algorithm, GateSettings, LossInputs
from megatron_armor.algorithms.importance import sampler_corrected_loss
from megatron_armor.algorithms.losses import LOG_RATIO_CLAMP
from megatron_armor.algorithms.registry import register_algorithm
from megatron_armor.config import ArmorConfig, KLConfig, MipuConfig


@torch.no_grad()
def gap_proxy(
    trainer_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
    trajectories: torch.Tensor | None = None,
) -> float:
    """T_post = -mean_i(rho_i * A_i), rho_i = exp(mean_t(log pi_{k+1} - log mu_{k+1})) over response i.

    trainer_logp, engine_logp, mask: [N, T] float32 of N validation responses sampled by mu_{k+1};
    advantages: [N] float32, group-relative within each validation group. trajectories: [N] long, the trajectory
    (0 .. M-1) each response belongs to (a multi-turn trajectory forked into several responses; None: each response
    its own): a trajectory is one response i of the formula, its rho over all its responses' tokens and its advantage
    theirs (they share it), so it counts once in the mean. Negative T_post: the
    trainer favours positive-advantage responses more than the engine does. Each token's log ratio
    is clamped to +-LOG_RATIO_CLAMP (as in `sampler_weights`), so an engine logprob of -inf counts
    as a large finite ratio; a non-finite T_post (NaN logprobs or advantages) raises FloatingPointError
    instead of silently failing `accept_update`.
    """
    log_ratio = (trainer_logp - engine_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    log_ratio = torch.where(mask > 0, log_ratio, 0.0)  # off-response positions may hold anything
    n = len(advantages)
    if trajectories is None:
        trajectories = torch.arange(n)
    count = int(trajectories.max()) + 1
    log_ratio_sum = torch.zeros(count, dtype=log_ratio.dtype).index_add_(0, trajectories, log_ratio.sum(1))
    tokens = torch.zeros(count, dtype=mask.dtype).index_add_(0, trajectories, mask.sum(1))
    first = torch.full((count,), n).scatter_reduce_(0, trajectories, torch.arange(n), reduce="amin")
    rho = torch.exp(log_ratio_sum / tokens.clamp(min=1.0))
    gap = float(-(rho * advantages[first]).mean())
    if not math.isfinite(gap):
        raise FloatingPointError(
            f"MIPU gap proxy T_post is {gap}: the gate batch has non-finite trainer/engine logprobs or advantages"
        )
    return gap


def tolerance(step: int, c_start: float, c_end: float, ramp_steps: int = 100) -> float:
    """c_t = c_start + min(t, ramp_steps) / ramp_steps * (c_end - c_start); constant after the ramp."""
    if ramp_steps <= 0:
        return c_end
    return c_start + min(step, ramp_steps) / ramp_steps * (c_end - c_start)


def accept_update(gap: float, c: float) -> bool:
    """Accept the candidate iff T_post >= -c."""
    return gap >= -c




@register_algorithm
class Mipu(Algorithm):
    """Step 1: dual-clip PPO on pi_theta / pi_old weighted by the corrected pi_old / mu (mipu.is_correction,
    mipu.w_max), symmetric clip eps with dual clip 1 + 2 eps by default, each response's token mean, plus the
    KL penalty (kl.coef); Step 2 (mipu.gate): accept or roll back every update by the gap proxy.

    The gate works in every rollout.mode: no rollout generates on the actor's engine while it pushes or rolls back
    weights. With one_step_off the rollout queued for step t+1 was sampled by theta_t, the weights before step t's
    update: a rollback restores them, so it trains on-policy (staleness 0); an accept leaves it one version old, which
    Step 1's weight pi_old / mu against the engine's logprobs corrects. With async the generator is stopped (or its
    engine paused, partial rollouts) from the step's push to the next step, the gate's pushes included: every buffered
    batch was sampled by kept weights, and a rollback, which keeps the weight version, leaves theirs as they were."""

    name = "mipu"
    config_sections = {"mipu": MipuConfig, "kl": KLConfig}
    uses_kl_penalty = True
    corrects_sampler = True  # Step 1's mipu.is_correction
    default_loss_aggregation = "seq_mean_token_mean"  # J_S1 (mipu.md §2)

    def __init__(self, cfg: ArmorConfig) -> None:
        super().__init__(cfg)
        self.settings = cfg.mipu

    @classmethod
    def default_clip_high(cls, clip_low: float) -> float:
        return clip_low  # symmetric eps (mipu.md §2)

    @classmethod
    def default_dual_clip(cls, clip_low: float) -> float:
        return 1.0 + 2.0 * clip_low

    def ppo_loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return sampler_corrected_loss(
            inputs.logprobs, inputs.old_logprobs, inputs.engine_logprobs, inputs.advantages, inputs.response_mask,
            correction=self.settings.is_correction, w_max=self.settings.w_max, aggregation=self.loss_aggregation,
            normalizer=1.0, **self.clip.as_kwargs(),
        )

    def update_gate(self) -> GateSettings | None:
        """The mipu section, whose gate fields the gate reads, unless mipu.gate is off."""
        return self.settings if self.settings.gate else None
