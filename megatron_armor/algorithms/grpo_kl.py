"""GRPO + KL: the GRPO baseline plus kl.coef times a KL estimate (kl.estimator k1 | k2 | k3) to the frozen
reference, the regulariser ARMOR is compared against (armor.md §3)."""

from __future__ import annotations

from megatron_armor.algorithms.grpo import Grpo
from megatron_armor.algorithms.registry import register_algorithm
from megatron_armor.config import KLConfig


@register_algorithm
class GrpoKL(Grpo):
    """`Grpo`'s loss + kl.coef * KL(pi_theta || pi_ref), aggregated as the policy loss."""

    name = "grpo_kl"
    config_sections = {"kl": KLConfig}
    uses_kl_penalty = True
