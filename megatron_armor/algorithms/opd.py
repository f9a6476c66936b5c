"""On-policy distillation (opd.md §1): the registered algorithm, and its per-token reverse-KL advantages
against a frozen teacher, optionally sparsified to a fraction of each response's tokens."""

from __future__ import annotations

import math
from typing import Literal

import torch

from megatron_armor.config.base import require
from megatron_armor.algorithms.base import ACTOR, TEACHER, StepSources
from megatron_armor.algorithms.grpo import Grpo
from megatron_armor.algorithms.reduce import masked_mean
from megatron_armor.algorithms.importance import ISCorrection
from megatron_armor.algorithms.registry import register_algorithm
from megatron_armor.config import ArmorConfig, OpdConfig

TOKEN_SELECTIONS = ("top", "random")
TokenSelection = Literal["top", "random"]


@torch.no_grad()
def sparse_token_mask(
    scores: torch.Tensor, mask: torch.Tensor, fraction: float, selection: TokenSelection,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """m_t of the token-sparsification variant: per response, keep k = ceil(fraction * T) of its T tokens.

    scores: [B, T] float32, the ranking key of "top" (the largest k are kept, ties to the earlier
    token); "random" keeps a uniformly random k-subset drawn from `generator`. mask: [B, T] response
    mask. Returns [B, T] float32 in {0, 1}, 0 off-response; a response with T >= 1 keeps >= 1 token.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"token fraction must be in (0, 1], got {fraction}")
    if selection not in TOKEN_SELECTIONS:
        raise ValueError(f"unknown token selection {selection!r}; choose one of {TOKEN_SELECTIONS}")
    response = mask > 0
    lengths = response.sum(-1)  # [B]
    # ceil(fraction * T) without float noise turning 0.3 * 10 into 4
    keep_counts = torch.ceil(lengths.double() * fraction - 1e-9).long()  # [B]
    if selection == "top":
        keys = scores.float()
    else:  # drawn on the CPU generator, so a seed gives the same tokens on any device
        keys = torch.rand(scores.shape, generator=generator).to(scores.device)
    keys = keys.masked_fill(~response, -math.inf)
    order = keys.argsort(dim=-1, descending=True, stable=True)  # [B, T] token index by rank
    positions = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    ranks = torch.empty_like(order).scatter_(-1, order, positions)  # [B, T] rank of each token
    return ((ranks < keep_counts[:, None]) & response).to(torch.float32)


@torch.no_grad()
def sparsify_log_ratio(
    log_ratio: torch.Tensor, mask: torch.Tensor, fraction: float, selection: TokenSelection,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """r_t <- T / sum(m) * m_t * r_t per response (opd.md §1 variants), m = `sparse_token_mask` keyed
    by r_t itself. log_ratio, mask: [B, T] float32 -> [B, T] float32; fraction 1 returns r unchanged."""
    if fraction == 1.0:
        return log_ratio
    keep = sparse_token_mask(log_ratio, mask, fraction, selection, generator)
    scale = (mask > 0).sum(-1, keepdim=True) / keep.sum(-1, keepdim=True).clamp(min=1.0)  # [B, 1] T / sum(m)
    return log_ratio * keep * scale


@torch.no_grad()
def opd_token_advantages(
    old_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float = 1.0,
    alpha: float = 1.0,
    sequence_advantages: torch.Tensor | None = None,
    token_fraction: float = 1.0,
    token_selection: TokenSelection = "top",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """A_t = alpha * (-beta * r_t) + (1 - alpha) * A_seq, r_t = old_logp - teacher_logp (detached).

    old_logp, teacher_logp, mask: [B, T] float32 (student at rollout time, teacher, response mask);
    sequence_advantages: [B] float32 GRPO advantages broadcast over tokens (needed when alpha < 1).
    alpha = 1 is pure OPD (A_base = 0). token_fraction < 1 first sparsifies r_t (`sparsify_log_ratio`
    with `token_selection`; `generator` drives "random"). Returns [B, T] float32, 0 off-response.
    """
    log_ratio = sparsify_log_ratio(old_logp - teacher_logp, mask, token_fraction, token_selection, generator)
    advantages = -beta * log_ratio
    if alpha < 1.0:
        if sequence_advantages is None:
            raise ValueError(f"sequence_advantages are required to mix OPD with GRPO (alpha={alpha} < 1)")
        advantages = alpha * advantages + (1.0 - alpha) * sequence_advantages[:, None]
    return advantages * mask


@torch.no_grad()
def reverse_kl(old_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Single-sample reverse KL(student || teacher): token mean of old_logp - teacher_logp. [B, T] -> 0-dim."""
    return masked_mean(old_logp - teacher_logp, mask)


@register_algorithm
class Opd(Grpo):
    """GRPO's dual-clip PPO loss on per-token advantages A_t = opd.alpha * (-opd.beta * r_t) + (1 - opd.alpha) *
    A_grpo, r_t = log pi_old - log q_teacher (`opd_token_advantages`). Every prompt is trained on (no group
    filter); with opd.rollouts teacher the teacher's never-synced engine samples the responses."""

    name = "opd"
    config_sections = {"opd": OpdConfig}
    reads_old_logprobs_before_update = True  # the token advantages are computed from them

    def __init__(self, cfg: ArmorConfig) -> None:
        super().__init__(cfg)
        self.settings = cfg.opd
        self.filters_groups = False  # OPD learns from every prompt

    @classmethod
    def step_sources(cls, cfg: ArmorConfig) -> StepSources:
        """The teacher's logprobs for the token advantages; the training responses sampled by the actor, or with
        opd.rollouts teacher by the teacher's engine."""
        return StepSources(sampler=TEACHER if cfg.opd.rollouts == "teacher" else ACTOR, scores=(TEACHER,))

    @classmethod
    def anchored_config(cls, cfg: ArmorConfig) -> None:
        """None: its teacher, not an anchor, is what keeps it close."""
        return None

    @classmethod
    def resolve_behaviour_correction(cls, cfg: ArmorConfig) -> ISCorrection:
        """none with opd.rollouts teacher: the teacher's engine, which no push changes, samples the responses and
        nothing weights its tokens toward pi_old (opd.md §1, variants); else the base rule."""
        return "none" if cfg.opd.rollouts == "teacher" else super().resolve_behaviour_correction(cfg)

    @classmethod
    def check_config(cls, cfg: ArmorConfig) -> None:
        super().check_config(cfg)
        opd, synthetic = cfg.opd, cfg.task.synthetic is not None
        warm_start = synthetic and cfg.task.warm_start.steps > 0
        require(opd.teacher_layout is None or opd.teacher_path is not None or synthetic,
                "opd.teacher_tensor/pipeline_parallel_size start a teacher server of opd.teacher_path: set "
                "opd.teacher_path (or opd.teacher_url for a server that runs already)")
        require(opd.teacher_url is not None or opd.teacher_path is not None or warm_start,
                "opd.teacher_path is required for algorithm.name opd (an HF checkpoint dir of the teacher; the "
                "synthetic task with task.warm_start.steps > 0 uses its warm start), or opd.teacher_url")
        if opd.rollouts == "teacher":
            clip = cls.resolve_clip(cfg)
            require(clip.low == 1.0 and clip.high == 1.0,
                    f"opd.rollouts teacher trains on off-policy tokens with the PPO ratio clip off (eps = 1.0, "
                    f"opd.md §1): set algorithm.clip_low=1.0 algorithm.clip_high=1.0, got {clip.low}/{clip.high}")
            require(cfg.algorithm.behaviour_correction in (None, "none"),
                    f"algorithm.behaviour_correction ({cfg.algorithm.behaviour_correction}) weights tokens by pi_old / "
                    f"mu, but opd.rollouts teacher trains on the teacher's tokens unweighted (opd.md §1): leave it "
                    f"unset")
            require(not cfg.rollout.partial_rollouts,
                    "rollout.partial_rollouts pauses the actor's engine at weight pushes, but opd.rollouts teacher "
                    "samples from the teacher's engine, which no push changes: set rollout.partial_rollouts false")
            require(cfg.rollout.backend_settings.in_process,
                    "opd.rollouts teacher samples from an in-process engine of opd.teacher_path; rollout.backend "
                    "sglang has no teacher rollout servers: use rollout.backend local, or opd.rollouts student")
            require(opd.teacher_path is not None or warm_start,
                    "opd.rollouts teacher needs the teacher's weights in the trainer for its rollout engine: set "
                    "opd.teacher_path (an HF checkpoint dir; opd.teacher_url alone only scores)")

    def token_advantages(
        self, old_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor | None, response_mask: torch.Tensor,
        sequence_advantages: torch.Tensor, generator: torch.Generator,
    ) -> torch.Tensor:
        opd = self.settings
        return opd_token_advantages(
            old_logprobs, teacher_logprobs, response_mask, beta=opd.beta, alpha=opd.alpha,
            sequence_advantages=sequence_advantages, token_fraction=opd.token_fraction,
            token_selection=opd.token_selection, generator=generator,
        )
