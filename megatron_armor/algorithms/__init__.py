"""RL objectives: the registered algorithms (one module each) and the pure math they share: losses,
advantages, group building, KL estimators, MIPU importance weights and gate, OPD advantages."""

from megatron_armor.algorithms.advantages import group_advantages
from megatron_armor.algorithms.armor import Armor
from megatron_armor.algorithms.base import (
    ACTOR, ANCHORS, REFERENCE, TEACHER, Algorithm, GateSettings, LossInputs, PolicyLossTerms, StepSources,
)
from megatron_armor.algorithms.groups import (
    GroupCollector, GroupStats, anchor_trajectories, build_groups, mix_kl_metrics, select_group, trajectories,
    trajectory_advantages, trajectory_members, trajectory_owners,
)
from megatron_armor.algorithms.grpo import Grpo
from megatron_armor.algorithms.grpo_kl import GrpoKL
from megatron_armor.algorithms.importance import IS_CORRECTIONS, mismatch_k3, sampler_corrected_loss, sampler_weights
from megatron_armor.algorithms.kl import kl_penalty
from megatron_armor.algorithms.losses import armor_policy_loss, dual_clip_ppo
from megatron_armor.algorithms.mipu import Mipu, accept_update, gap_proxy, tolerance
from megatron_armor.algorithms.opd import Opd, opd_token_advantages, reverse_kl, sparse_token_mask, sparsify_log_ratio
from megatron_armor.algorithms.registry import (
    ANCHORED_ALGORITHM, algorithm_class, build_algorithm, build_anchored_algorithm,
    check_algorithm_config, register_algorithm, registered_algorithms,
    unregister_algorithm,
)

__all__ = [
    "ACTOR", "ANCHORED_ALGORITHM", "ANCHORS", "IS_CORRECTIONS", "REFERENCE", "TEACHER", "Algorithm", "Armor",
    "GateSettings", "GroupCollector", "GroupStats", "Grpo", "GrpoKL", "LossInputs", "Mipu", "Opd", "PolicyLossTerms",
    "StepSources", "accept_update", "algorithm_class", "anchor_trajectories", "armor_policy_loss",
    "build_algorithm", "build_anchored_algorithm", "build_groups", "check_algorithm_config", "dual_clip_ppo", "gap_proxy", "group_advantages",
    "kl_penalty", "mismatch_k3", "mix_kl_metrics", "opd_token_advantages", "register_algorithm",
    "registered_algorithms", "reverse_kl", "sampler_corrected_loss", "sampler_weights", "select_group",
    "sparse_token_mask", "sparsify_log_ratio", "tolerance", "trajectories", "trajectory_advantages",
    "trajectory_members", "trajectory_owners", "unregister_algorithm",
]
