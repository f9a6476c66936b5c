"""The `Algorithm` protocol: what an RL objective contributes to an RL step, and its loss.

An algorithm is an object built from the run config. The trainer never asks for its name, nor interprets flags of
it; it takes what the algorithm contributes:
- `sources` (`StepSources`): the rollout sources a step samples from (the policy whose engine samples the training
  responses; sources that add samples to the groups, ARMOR's anchors) and the policies whose logprobs every batch
  needs (the reference, the OPD teacher), by the names the trainer's policies carry (`ACTOR`, `REFERENCE`, `TEACHER`);
- its group filter (`filters_groups`), its per-micro-batch loss (`policy_loss`), and its hooks: per-token advantages
  computed from the scored batch (`token_advantages`, OPD) and a post-update accept/roll-back gate (`update_gate`,
  MIPU).
Each built-in lives in its own module and registers itself (`algorithms/registry.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from megatron_armor.algorithms.importance import ISCorrection, corrected_weights
from megatron_armor.algorithms.kl import kl_penalty
from megatron_armor.algorithms.reduce import LossAggregation, aggregate_loss, check_aggregation
from megatron_armor.config.base import require

if TYPE_CHECKING:
    from megatron_armor.config import ArmorConfig, SamplingConfig


# The trainer's policies, by the names an algorithm asks for them (`trainer/step_inputs/policies.py` `Policy.name`;
# also their entries in a checkpoint), and ARMOR's anchors, a rollout source of the trainer
# (trainer/rollouts/anchors.py).
ACTOR, REFERENCE, TEACHER = "actor", "ref", "teacher"
ANCHORS = "anchors"


@dataclass(frozen=True)
class StepSources:
    """What an algorithm asks the trainer to bring to every RL step.

    sampler: the policy whose engine samples the training responses (ACTOR; OPD's off-policy variant: TEACHER);
    extra_samples: rollout sources whose samples join each prompt's group (ANCHORS: ARMOR's reference samples, a
    group kept only with a correct one);
    scores: the policies besides the actor whose logprobs every training batch carries (REFERENCE: the KL penalty,
    ARMOR's mixed ratio; TEACHER: OPD's advantages).
    """

    sampler: str = ACTOR
    extra_samples: tuple[str, ...] = ()
    scores: tuple[str, ...] = ()

    def uses(self, policy: str) -> bool:
        """Whether a step needs the policy `policy` (it samples, or it scores; ANCHORS are the reference's samples)."""
        return policy in (self.sampler, *self.scores) or (policy == REFERENCE and ANCHORS in self.extra_samples)


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch as a policy loss sees it; every tensor [b, S] float32 (mask: 1 on response tokens).

    logprobs carries the gradient (log pi_theta of the sampled tokens); old_logprobs are the trainer's at
    rollout time, engine_logprobs the sampler's, ref_logprobs the reference's (None when not needed);
    advantages are per token (sequence advantages broadcast, or OPD's token advantages). token_weights (detached;
    None: 1) multiply each token's policy term: the behaviour correction `Algorithm.policy_loss` sets. is_anchor [b]
    bool (None: no anchors) marks rows the reference sampled (ARMOR's anchors).
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None
    engine_logprobs: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    token_weights: torch.Tensor | None = None
    is_anchor: torch.Tensor | None = None


@dataclass
class PolicyLossTerms:
    """A micro-batch's loss as partial sums over its aggregation units (normalizer 1).

    loss: the 0-dim value to differentiate (the policy term plus any penalty); policy_loss: the policy
    term alone (detached); token_means: detached 0-dim masked token means (e.g. clip_fraction; logged as
    loss/<name>, or as <name> when it names its own section, e.g. async/importance_weight_mean);
    per_unit: detached 0-dim partial sums reported per aggregation unit, as policy_loss (e.g. kl_to_ref).
    """

    loss: torch.Tensor
    policy_loss: torch.Tensor
    token_means: dict[str, torch.Tensor]
    per_unit: dict[str, torch.Tensor] = field(default_factory=dict)


class GateSettings(Protocol):
    """What a post-update gate (MIPU Step 2) reads of the section of the algorithm that asks for one (`update_gate`:
    the mipu section itself): tolerance c_t from c_start to c_end over ramp_steps RL steps, measured on gate_prompts
    held-out prompts x gate_n responses each."""

    c_start: float
    c_end: float
    ramp_steps: int
    gate_prompts: int
    gate_n: int


@dataclass(frozen=True)
class ClipConfig:
    """Dual-clip PPO bounds: ratio clipped to [1 - low, 1 + high], negative-advantage loss bounded by dual * |A|."""

    low: float
    high: float
    dual: float

    def as_kwargs(self) -> dict[str, float]:
        return dict(clip_low=self.low, clip_high=self.high, dual_clip=self.dual)


class Algorithm:
    """Base of the registered RL objectives (see the module docstring for what the trainer asks).

    Subclasses set `name` and implement `ppo_loss`; `step_sources` says what a step brings them (default: the
    actor's samples, and the reference's logprobs for the KL penalty), class methods their config defaults and rules.
    The settings of their own config section they read in `__init__`.
    """

    name: ClassVar[str]
    # its own config sections: name -> settings dataclass (`config.section_registry`); registering the algorithm
    # registers them, so they load from YAML and flags and `--help` lists them. (Every algorithm also reads the
    # built-in kl and opd sections, which the config package registers itself.)
    config_sections: ClassVar[Mapping[str, type]] = {}
    default_loss_aggregation: ClassVar[LossAggregation] = "token_mean"
    uses_kl_penalty: ClassVar[bool] = False  # adds kl.coef * KL(pi_theta || pi_ref) to the loss
    # its own loss weights each token by pi_old / mu (MIPU), so algorithm.behaviour_correction does not apply
    corrects_sampler: ClassVar[bool] = False
    # something before the update reads the actor's old-policy logprobs (e.g. `token_advantages`), so an exactly
    # on-policy step cannot take them from the update's own forward
    reads_old_logprobs_before_update: ClassVar[bool] = False

    def __init__(self, cfg: ArmorConfig) -> None:
        section = cfg.algorithm
        self.clip = self.resolve_clip(cfg)
        self.loss_aggregation: LossAggregation = section.loss_aggregation or self.default_loss_aggregation
        check_aggregation(self.loss_aggregation)
        self.kl_coef = cfg.kl.coef if self.uses_kl_penalty else 0.0
        self.kl_estimator = cfg.kl.estimator
        self.filters_groups = section.filter_groups
        self.behaviour_correction: ISCorrection = self.resolve_behaviour_correction(cfg)
        self.behaviour_w_max = section.behaviour_w_max
        self.sources = self.step_sources(cfg)

    # ----- what a step brings it --------------------------------------------------------------
    @classmethod
    def step_sources(cls, cfg: ArmorConfig) -> StepSources:
        """What every RL step of a run of `cfg` brings this algorithm: the actor's samples, and the reference's
        logprobs when it adds a KL penalty (kl.coef > 0)."""
        return StepSources(scores=(REFERENCE,) if cls.uses_kl_penalty and cfg.kl.coef > 0 else ())

    @property
    def per_unit_stats(self) -> tuple[str, ...]:
        """Names of the `PolicyLossTerms.per_unit` statistics `policy_loss` returns (the same every call)."""
        return ("kl_to_ref",) if self.kl_coef > 0 else ()

    # ----- config ---------------------------------------------------------------------------
    @classmethod
    def on_policy_samples(cls, sampling: SamplingConfig) -> int:
        """On-policy samples per prompt: the whole group of rollout.sampling.n_samples (an algorithm whose groups
        hold other samples, ARMOR's anchor, says otherwise); rollout.sampling.actor_n, when set, must agree."""
        return sampling.n_samples

    @classmethod
    def anchored_config(cls, cfg: ArmorConfig) -> ArmorConfig | None:
        """The config a run of `cfg` continues with once the collapse monitor's anchor action fires
        (trainer/guard/anchor_switch.py), or None when a run of this algorithm cannot be anchored (the default)."""
        return None

    @classmethod
    def default_clip_high(cls, clip_low: float) -> float:
        return 0.28

    @classmethod
    def default_dual_clip(cls, clip_low: float) -> float:
        return 10.0

    @classmethod
    def resolve_clip(cls, cfg: ArmorConfig) -> ClipConfig:
        """algorithm.clip_* with this algorithm's defaults for the unset ones."""
        section = cfg.algorithm
        high = section.clip_high if section.clip_high is not None else cls.default_clip_high(section.clip_low)
        dual = section.dual_clip if section.dual_clip is not None else cls.default_dual_clip(section.clip_low)
        return ClipConfig(low=section.clip_low, high=high, dual=dual)

    @classmethod
    def resolve_behaviour_correction(cls, cfg: ArmorConfig) -> ISCorrection:
        """algorithm.behaviour_correction, by default tis when samples may come from older weights than the
        trainer's (rollout.mode other than sync), else none; none for an algorithm that corrects itself (MIPU)."""
        if cls.corrects_sampler:
            return "none"
        chosen = cfg.algorithm.behaviour_correction
        return chosen if chosen is not None else ("none" if cfg.rollout.mode == "sync" else "tis")

    @classmethod
    def check_config(cls, cfg: ArmorConfig) -> None:
        """ConfigError for settings this algorithm cannot run with (cross-section rules that depend on it)."""
        require(not (cls.corrects_sampler and cfg.algorithm.behaviour_correction is not None),
                f"{cls.name} weights tokens by pi_old / mu itself (mipu.is_correction): leave "
                f"algorithm.behaviour_correction unset")
        sampling, anchors = cfg.rollout.sampling, cfg.rollout.anchors
        on_policy = cls.on_policy_samples(sampling)
        require(sampling.actor_n in (None, on_policy),
                f"rollout.sampling.actor_n must be {on_policy} for {cls.name} with rollout.sampling.n_samples "
                f"{sampling.n_samples}, got {sampling.actor_n} (leave it unset: {cls.name} derives it)")
        clip = cls.resolve_clip(cfg)  # the section checked the values it was given; these are with the defaults
        require(clip.high >= 0, f"algorithm.clip_low/clip_high must be >= 0, got {clip.low}/{clip.high}")
        require(clip.dual > 1, f"algorithm.dual_clip must be > 1, got {clip.dual}")
        sources = cls.step_sources(cfg)
        if ANCHORS in sources.extra_samples:
            require(anchors.ref_n >= 1, f"rollout.anchors.ref_n must be >= 1 for {cls.name}, got {anchors.ref_n}")
            require(cfg.rollout.backend_settings.in_process or anchors.engine == "shared"
                    or cfg.model.lora.adapter_sync or bool(cfg.rollout.sglang.ref_urls),
                    f"rollout.sglang.ref_urls is required for {cls.name} with rollout.backend sglang (servers of the "
                    f"reference policy), or set rollout.anchors.engine shared to sample anchors from the actor's servers"
                    f"{' (or model.lora.weight_sync adapter: from their base)' if cfg.model.lora.enabled else ''}")
        else:
            require(anchors.engine == "separate" and not anchors.cache,
                    f"rollout.anchors.engine ({anchors.engine}) and rollout.anchors.cache ({anchors.cache}) apply to "
                    f"anchors; {cls.name} samples none: leave them at separate / false")
        if not sources.uses(TEACHER):
            cls.check_no_teacher_settings(cfg)

    @classmethod
    def check_no_teacher_settings(cls, cfg: ArmorConfig) -> None:
        """The opd section's teacher, rollout and sparsification settings need an algorithm with a teacher."""
        opd = cfg.opd
        require(opd.token_fraction == 1.0,
                f"opd.token_fraction ({opd.token_fraction}) sparsifies the teacher's per-token advantages; {cls.name} "
                f"has none: leave it at 1.0")
        require(opd.teacher_url is None and opd.teacher_layout is None,
                f"opd.teacher_url / teacher_*_parallel_size configure the OPD teacher; {cls.name} has none: unset them")
        require(opd.rollouts == "student",
                f"opd.rollouts ({opd.rollouts}) picks who samples opd's training responses; {cls.name} samples from "
                f"the actor: leave it at student")

    # ----- the loss -------------------------------------------------------------------------
    def policy_loss(self, inputs: LossInputs) -> PolicyLossTerms:
        """The micro-batch's loss as partial sums (`PolicyLossTerms`): `ppo_loss`, plus kl.coef times the
        aggregated KL estimate to the reference when the algorithm uses the KL penalty. With a behaviour
        correction each token's policy term is weighted by its importance weight (`LossInputs.token_weights`), whose
        statistics join the token means as async/importance_weight_mean and async/clipped_fraction. Anchors weigh 1:
        their sampler is the reference, frozen between resets, so no update leaves them stale (the weight corrects
        the actor's engine lagging the trainer)."""
        weight_stats = {}
        if self.behaviour_correction != "none":
            actor_rows = None if inputs.is_anchor is None else ~inputs.is_anchor
            weights = corrected_weights(inputs.old_logprobs, inputs.engine_logprobs, inputs.response_mask,
                                        self.behaviour_correction, self.behaviour_w_max, actor_rows)
            inputs = dataclasses.replace(inputs, token_weights=weights.weights)
            weight_stats = {"async/importance_weight_mean": weights.mean,
                            "async/clipped_fraction": weights.truncated_fraction}
        loss, stats = self.ppo_loss(inputs)
        stats.pop("num_tokens", None)
        stats.update(weight_stats)
        terms = PolicyLossTerms(loss=loss, policy_loss=loss.detach(), token_means=stats)
        if self.kl_coef > 0:
            kl = self.aggregate(kl_penalty(inputs.logprobs, inputs.ref_logprobs, self.kl_estimator), inputs)
            terms.loss = loss + self.kl_coef * kl
            terms.per_unit["kl_to_ref"] = kl.detach()
        return terms

    def ppo_loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(partial-sum policy loss, detached token-mean statistics) of one micro-batch."""
        raise NotImplementedError

    def aggregate(self, values: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
        """Partial sum of per-token `values` [b, S] over the micro-batch's units (the trainer divides by all units)."""
        return aggregate_loss(values, inputs.response_mask, self.loss_aggregation, normalizer=1.0)

    # ----- optional hooks -------------------------------------------------------------------
    def token_advantages(
        self, old_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor | None, response_mask: torch.Tensor,
        sequence_advantages: torch.Tensor, generator: torch.Generator,
    ) -> torch.Tensor | None:
        """Per-token advantages [B, S] from the scored batch, or None to broadcast `sequence_advantages` [B]."""
        return None

    def old_logprobs_from_update(self, mini_batches_per_step: int) -> bool:
        """Whether the update's own forward gives the old-policy logprobs (detached) instead of a separate pass: with
        one mini-batch per RL step the update runs at the very weights the old-policy pass would score with, so its
        ratios start at exactly 1 either way; unless something reads them before the update."""
        return mini_batches_per_step == 1 and not self.reads_old_logprobs_before_update

    def update_gate(self) -> GateSettings | None:
        """Settings of a post-update accept / roll-back gate (its section), or None for none."""
        return None
