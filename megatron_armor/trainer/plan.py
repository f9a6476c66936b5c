"""`StepPlan`: the batch geometry and algorithm switches of an RL step, derived from the config once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepPlan:
    """Batch geometry and algorithm switches of an RL step (derived from the config).

    The algorithm's name is read in the three properties below and nowhere else in the step.
    """

    algorithm: str  # "armor" | "grpo" | "grpo_kl" | "mipu" | "opd"
    train_batch_size: int  # prompts per step
    mini_batch_size: int  # prompts per optimizer step
    micro_batch_size: int  # sequences per forward/backward
    actor_n: int
    ref_n: int
    filter_groups: bool
    max_num_gen_batches: int
    allow_partial_batch: bool
    adv_eps: float
    ref_reset_period: int
    seed: int
    advantage_baseline: str = "mean"  # "mean" (GRPO) | "quantile" (QAE): b of A = (R - b) / (std + eps)
    baseline_quantile: float = 0.45
    opd_beta: float = 1.0  # A_t = opd_alpha * (-opd_beta * (old - teacher)) + (1 - opd_alpha) * A_grpo
    opd_alpha: float = 1.0
    opd_token_fraction: float = 1.0  # keep ceil(fraction * T) tokens of each response's r_t (1: all)
    opd_token_selection: str = "top"  # "top" (largest r_t) | "random" (algorithms/opd.py)
    kl_coef: float = 0.0  # KL-to-reference loss weight (grpo_kl, mipu); > 0 needs reference logprobs

    @property
    def uses_anchors(self) -> bool:
        """ARMOR: the reference samples anchors, and a group needs a correct one."""
        return self.algorithm == "armor"

    @property
    def needs_ref_logprobs(self) -> bool:
        """The loss reads the reference's logprobs (ARMOR's mixture, a KL-to-reference term)."""
        return self.algorithm == "armor" or self.kl_coef > 0

    @property
    def distills(self) -> bool:
        """OPD: a teacher scores every response and its per-token advantages replace the sequence ones."""
        return self.algorithm == "opd"

    def resets_reference_after(self, step: int) -> bool:
        """Whether RL step `step` (0-based) ends with a reference reset (every `ref_reset_period` steps)."""
        return bool(self.ref_reset_period) and (step + 1) % self.ref_reset_period == 0
