"""ARMOR (armor.md): on-policy rollouts plus a correct anchor from the reference in every group, trained with
the mixed ratio (a pi_theta + (1 - a) pi_ref) / (a pi_old + (1 - a) pi_ref), dual-clip PPO, no KL term."""

from __future__ import annotations

from megatron_armor.algorithms.base import ANCHORS, REFERENCE, StepSources
from megatron_armor.algorithms.grpo import Grpo
from megatron_armor.algorithms.registry import register_algorithm
from megatron_armor.config import ArmorConfig, MixedRatioConfig, SamplingConfig


@register_algorithm
class Armor(Grpo):
    """GRPO's dual-clip loss on the mixed ratio (armor.alpha is its a) over groups of n_samples - 1 on-policy
    samples + the first correct anchor; prompts without a correct anchor are dropped."""

    name = "armor"
    config_sections = {"armor": MixedRatioConfig}

    def __init__(self, cfg: ArmorConfig) -> None:
        super().__init__(cfg)
        self.alpha = cfg.armor.alpha

    @classmethod
    def step_sources(cls, cfg: ArmorConfig) -> StepSources:
        """The actor's samples and the anchors (trainer/rollouts/anchors.py), scored by the reference for the mixed
        ratio."""
        return StepSources(extra_samples=(ANCHORS,), scores=(REFERENCE,))

    @classmethod
    def on_policy_samples(cls, sampling: SamplingConfig) -> int:
        """n_samples - 1: a group's last place is its anchor's."""
        return sampling.n_samples - 1
