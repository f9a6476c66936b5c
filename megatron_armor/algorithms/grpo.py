"""GRPO as ARMOR's baseline (armor.md §3): DAPO-style dual-clip PPO on pi_theta / pi_old with group
advantages over on-policy samples only, no anchors and no KL term."""

from __future__ import annotations

import torch

from megatron_armor.algorithms.base import Algorithm, LossInputs
from megatron_armor.algorithms.losses import armor_policy_loss
from megatron_armor.algorithms.registry import register_algorithm


@register_algorithm
class Grpo(Algorithm):
    """Dual-clip PPO: `armor_policy_loss` with mixing off. Subclasses that mix the ratio with the reference
    (ARMOR) set `alpha` < 1."""

    name = "grpo"
    can_anchor = True  # grpo_kl and armor inherit it
    alpha: float = 1.0  # actor weight of the mixed ratio; 1 is the plain ratio pi_theta / pi_old

    def ppo_loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return armor_policy_loss(
            inputs.logprobs, inputs.old_logprobs, inputs.ref_logprobs, inputs.advantages, inputs.response_mask,
            alpha=self.alpha, aggregation=self.loss_aggregation, normalizer=1.0, token_weights=inputs.token_weights,
            **self.clip.as_kwargs(),
        )
