"""Pure math of the RL objectives: losses, advantages, group building, KL estimators."""

from megatron_armor.algorithms.advantages import group_advantages
from megatron_armor.algorithms.groups import GroupCollector, GroupStats, build_groups, mix_kl_metrics, select_group
from megatron_armor.algorithms.kl import kl_penalty
from megatron_armor.algorithms.losses import armor_policy_loss

__all__ = [
    "GroupCollector", "GroupStats", "armor_policy_loss", "build_groups", "group_advantages", "kl_penalty",
    "mix_kl_metrics", "select_group",
]
