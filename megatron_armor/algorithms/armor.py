"""ARMOR (armor.md): on-policy rollouts plus a correct anchor from the reference in every group, trained with
the mixed ratio (a pi_theta + (1 - a) pi_ref) / (a pi_old + (1 - a) pi_ref), dual-clip PPO, no KL term."""

from __future__ import annotations

from megatron_armor.config.base import require
from megatron_armor.algorithms.grpo import Grpo
from megatron_armor.algorithms.registry import register_algorithm
from megatron_armor.config import ArmorConfig


@register_algorithm
class Armor(Grpo):
    """GRPO's dual-clip loss on the mixed ratio (armor.alpha is its a) over groups of actor_n on-policy
    samples + the first correct anchor (n_samples = actor_n + 1); prompts without a correct anchor are dropped."""

    name = "armor"
    uses_anchors = True

    def __init__(self, cfg: ArmorConfig) -> None:
        super().__init__(cfg)
        self.alpha = cfg.armor.alpha

    @property
    def needs_ref_logprobs(self) -> bool:
        return True

    @classmethod
    def check_config(cls, cfg: ArmorConfig) -> None:
        super().check_config(cfg)
        sampling = cfg.rollout.sampling
        require(sampling.actor_n == sampling.n_samples - 1,
                f"rollout.sampling.actor_n must be rollout.sampling.n_samples - 1 = {sampling.n_samples - 1} for "
                f"armor (groups are actor_n on-policy samples + 1 anchor), got {sampling.actor_n}")
