"""GRPO as ARMOR's baseline (armor.md §3): DAPO-style dual-clip PPO on pi_theta / pi_old with group
advantages over on-policy samples only, no anchors and no KL term."""

from __future__ import annotations

import dataclasses

import torch

from megatron_armor.algorithms.base import Algorithm, LossInputs
from megatron_armor.algorithms.losses import armor_policy_loss
from megatron_armor.algorithms.registry import ANCHORED_ALGORITHM, register_algorithm
from megatron_armor.config import ArmorConfig


@register_algorithm
class Grpo(Algorithm):
    """Dual-clip PPO: `armor_policy_loss` with mixing off. Subclasses that mix the ratio with the reference
    (ARMOR) set `alpha` < 1."""

    name = "grpo"
    alpha: float = 1.0  # actor weight of the mixed ratio; 1 is the plain ratio pi_theta / pi_old

    @classmethod
    def anchored_config(cls, cfg: ArmorConfig) -> ArmorConfig:
        """ARMOR (`ANCHORED_ALGORITHM`) continues a GRPO-style run (grpo_kl and armor inherit this): its groups and
        loss are GRPO's, so ARMOR's anchors and mixed ratio continue it, with groups of the run's on-policy samples per
        prompt + 1 anchor and every other setting the run's own (ARMOR's from the armor section and rollout.anchors)."""
        rollout = cfg.rollout
        sampling = dataclasses.replace(rollout.sampling, n_samples=cls.on_policy_samples(rollout.sampling) + 1,
                                       actor_n=None)
        return dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, name=ANCHORED_ALGORITHM),
                                   rollout=dataclasses.replace(rollout, sampling=sampling))

    def ppo_loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return armor_policy_loss(
            inputs.logprobs, inputs.old_logprobs, inputs.ref_logprobs, inputs.advantages, inputs.response_mask,
            alpha=self.alpha, aggregation=self.loss_aggregation, normalizer=1.0, token_weights=inputs.token_weights,
            **self.clip.as_kwargs(),
        )
