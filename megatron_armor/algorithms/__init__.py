"""Pure math of the RL objectives: losses, advantages, group building, KL estimators, MIPU, OPD."""

from megatron_armor.algorithms.advantages import group_advantages
from megatron_armor.algorithms.groups import GroupCollector, GroupStats, build_groups, mix_kl_metrics, select_group
from megatron_armor.algorithms.importance import IS_CORRECTIONS, mismatch_k3, sampler_corrected_loss, sampler_weights
from megatron_armor.algorithms.kl import kl_penalty
from megatron_armor.algorithms.losses import armor_policy_loss, dual_clip_ppo
from megatron_armor.algorithms.mipu import accept_update, gap_proxy, tolerance
from megatron_armor.algorithms.opd import opd_token_advantages, reverse_kl, sparse_token_mask, sparsify_log_ratio

__all__ = [
    "IS_CORRECTIONS", "GroupCollector", "GroupStats", "accept_update", "armor_policy_loss", "build_groups",
    "dual_clip_ppo", "gap_proxy", "group_advantages", "kl_penalty", "mismatch_k3", "mix_kl_metrics",
    "opd_token_advantages", "reverse_kl", "sampler_corrected_loss", "sampler_weights", "select_group",
    "sparse_token_mask", "sparsify_log_ratio", "tolerance",
]
