"""The algorithm sections: `algorithm` (the policy loss and batch shared by every algorithm) and the built-in
algorithms' own sections, registered here (`section_registry`): `armor` (mixed ratio), `kl` (KL-to-reference loss),
`mipu`, `opd`.

Defaults and rules that depend on which algorithm runs belong to the algorithm objects
(`megatron_armor.algorithms`), which check them when the run's algorithm is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_armor.config.base import check_choices, doc, require, require_at_least
from megatron_armor.config.section_registry import register_sections


@dataclass
class AlgorithmConfig:
    """Which algorithm trains, and the PPO-style loss, group filtering and advantages they all use."""

    name: str = doc(
        "armor", "a registered algorithm: armor | grpo (dual-clip PPO, no anchors) | grpo_kl | mipu (sampler-referenced "
        "loss + gated sync) | opd (on-policy distillation from opd.teacher_path), one a plug-in registered "
        "(megatron_armor.algorithms.register_algorithm), or a plug-in class as package.module:ClassName"
    )
    clip_low: float = doc(0.2, "PPO ratio clip epsilon below 1")
    clip_high: float | None = doc(
        None, "PPO ratio clip epsilon above 1; default: clip_low for mipu (symmetric eps, mipu.md §2), 0.28 otherwise"
    )
    dual_clip: float | None = doc(
        None, "dual-clip constant c bounding negative-advantage losses; default: 1 + 2 clip_low for mipu (1.4), "
        "10 otherwise"
    )
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean"] | None = doc(
        None, "policy-loss reduction: token_mean (over all response tokens) | seq_mean_token_mean (token mean per "
        "response, then mean over responses); default: seq_mean_token_mean for mipu (J_S1), token_mean otherwise"
    )
    behaviour_correction: Literal["none", "tis", "mis"] | None = doc(
        None, "decoupled PPO (AReaL; mipu.md Step 1): each token's policy term times an importance weight "
        "w = pi_old / mu of the trainer's old (proximal) policy against the behaviour policy mu that sampled it (the "
        "engine's logprobs): tis (min(w, behaviour_w_max)) | mis (1[w <= behaviour_w_max]) | none (w = 1); default: "
        "tis with rollout.mode one_step_off or async, none in sync mode. ARMOR's anchors weigh 1 (the frozen "
        "reference sampled them), as opd.rollouts teacher's tokens do (none). mipu has its own (mipu.is_correction)"
    )
    behaviour_w_max: float = doc(2.0, "cap of the behaviour importance weight (algorithm.behaviour_correction)")
    filter_groups: bool = doc(True, "drop prompts whose on-policy samples are all correct or all wrong")
    max_num_gen_batches: int = doc(10, "generation batches per step before giving up on filling the batch")
    allow_partial_batch: bool = doc(
        False, "train on fewer prompts instead of failing when filtering leaves too few (cut to a multiple of "
        "parallel.data_parallel_size; a step left with none skips its update: train/update_skipped)"
    )
    adv_eps: float = doc(1e-6, "epsilon of the GRPO advantage normalisation")
    advantage_baseline: Literal["mean", "quantile"] = doc(
        "mean", "baseline b of A = (R - b) / (std + eps) within a group: mean (GRPO) | quantile (QAE: "
        "baseline_quantile of the group's rewards, linear interpolation)"
    )
    baseline_quantile: float = doc(0.45, "quantile of the QAE baseline (advantage_baseline quantile)")
    ref_reset_period: int = doc(
        0, "copy the actor into the reference every N steps (0: frozen); checkpoints then hold the reference, and "
        "a resume restores a checkpoint's reference whatever this is set to. Under model.lora the reference stays the "
        "base: every N steps the adapters and their optimizer state go back to the best checkpoint's "
        "(checkpoint.keep_best) unless the step's validation is a new best"
    )

    def __post_init__(self) -> None:
        check_choices("algorithm", self)
        require_at_least("algorithm", self, ("max_num_gen_batches",), 1)
        require_at_least("algorithm", self, ("ref_reset_period",), 0)
        require(self.clip_low <= 1, f"algorithm.clip_low must be <= 1 (1: no lower clip), got {self.clip_low}")
        require(self.clip_low >= 0 and (self.clip_high is None or self.clip_high >= 0),
                f"algorithm.clip_low/clip_high must be >= 0, got {self.clip_low}/{self.clip_high}")
        require(self.dual_clip is None or self.dual_clip > 1, f"algorithm.dual_clip must be > 1, got {self.dual_clip}")
        require(self.behaviour_w_max >= 1, f"algorithm.behaviour_w_max must be >= 1, got {self.behaviour_w_max}")
        require(0.0 <= self.baseline_quantile <= 1.0,
                f"algorithm.baseline_quantile must be in [0, 1], got {self.baseline_quantile}")


@dataclass
class MixedRatioConfig:
    """ARMOR's mixed importance ratio over on-policy samples and anchors (armor.md)."""

    alpha: float = doc(0.9375, "actor weight of the mixed ratio (armor)")

    def __post_init__(self) -> None:
        require(0.0 < self.alpha <= 1.0, f"armor.alpha must be in (0, 1], got {self.alpha}")


@dataclass
class KLConfig:
    """The KL-to-reference loss term of grpo_kl and mipu."""

    coef: float = doc(0.001, "KL-to-reference loss coefficient of grpo_kl and mipu (0: off)")
    estimator: Literal["k1", "k2", "k3"] = doc("k3", "KL estimator of grpo_kl and mipu")

    def __post_init__(self) -> None:
        check_choices("kl", self)
        require(self.coef >= 0, f"kl.coef must be >= 0, got {self.coef}")


@dataclass
class MipuConfig:
    """MIPU (mipu.md): Step 1's sampler-referenced importance correction and Step 2's update gate."""

    is_correction: Literal["tis", "mis", "none"] = doc(
        "tis", "Step 1 weight of pi_old/mu per token: tis min(w, w_max) | mis 1[w <= w_max] | none"
    )
    w_max: float = doc(2.0, "truncation / masking bound of the importance weight")
    gate: bool = doc(True, "Step 2: accept or roll back each update by the post-update gap proxy")
    c_start: float = doc(4e-3, "tolerance c at step 0 (accept iff gap proxy >= -c)")
    c_end: float = doc(1e-3, "tolerance c after the ramp")
    ramp_steps: int = doc(100, "steps over which c goes linearly from c_start to c_end")
    gate_prompts: int = doc(
        8, "held-out prompts (from the validation set, scored by reward.val_fn without the overlong penalty) "
        "per gate check; the gate's accept decisions then depend on validation prompts, so report accuracy on "
        "a separate test set when that matters"
    )
    gate_n: int = doc(8, "responses per held-out prompt (validation group size)")

    def __post_init__(self) -> None:
        check_choices("mipu", self)
        require(self.w_max > 0, f"mipu.w_max must be > 0, got {self.w_max}")
        require(self.ramp_steps >= 0, f"mipu.ramp_steps must be >= 0, got {self.ramp_steps}")
        require(self.gate_prompts >= 1, f"mipu.gate_prompts must be >= 1, got {self.gate_prompts}")
        require(self.gate_n >= 2, f"mipu.gate_n must be >= 2 for group advantages, got {self.gate_n}")


@dataclass
class OpdConfig:
    """On-policy distillation (opd.md): the per-token advantage from a frozen teacher, and where the teacher runs."""

    beta: float = doc(1.0, "reverse-KL coefficient beta of A_t = -beta (log pi_old - log q_teacher)")
    alpha: float = doc(1.0, "weight of the distillation advantage; 1 - alpha goes to the GRPO advantage")
    token_fraction: float = doc(
        1.0, "token sparsification rho in (0, 1]: keep ceil(rho T) of a response's T tokens, rescale their "
        "r_t by T / kept (1: off)"
    )
    token_selection: Literal["top", "random"] = doc(
        "top", "tokens kept under sparsification: top (largest r_t = log pi_old - log q_teacher) | random"
    )
    rollouts: Literal["student", "teacher"] = doc(
        "student", "training responses: student (on-policy, sampled by the actor's engine) | teacher (the "
        "off-policy variant: sampled by a never-synced engine of opd.teacher_path, scored and trained on exactly "
        "as student ones, no importance correction; needs the ratio clip off, algorithm.clip_low = clip_high = "
        "1.0, and rollout.backend local); train/reward_mean and train/accuracy then measure the teacher's samples, "
        "opd/reverse_kl is the mean r_t on them (an estimate of -KL(q_teacher || pi)), and mismatch/* is not logged"
    )
    teacher_path: str | None = doc(
        None, "HF checkpoint dir of the frozen teacher (same vocabulary; may be larger; built with the student's "
        "TP/PP; synthetic task: default the warm start, distilled into the untrained model)"
    )
    teacher_url: str | None = doc(
        None, "comma-separated URLs of running teacher scoring servers (`armor serve-teacher`, or SGLang "
        "serving the teacher); instead of a teacher in the trainer's processes"
    )
    teacher_tensor_parallel_size: int | None = doc(
        None, "teacher at its own layout: the trainer starts a scoring server of opd.teacher_path with this "
        "tensor-parallel size (null: the teacher shares the student's processes and layout)"
    )
    teacher_pipeline_parallel_size: int | None = doc(
        None, "pipeline-parallel size of the teacher server the trainer starts (null: 1 when "
        "teacher_tensor_parallel_size is set)"
    )

    def __post_init__(self) -> None:
        check_choices("opd", self)
        require(0.0 <= self.alpha <= 1.0, f"opd.alpha must be in [0, 1], got {self.alpha}")
        require(0.0 < self.token_fraction <= 1.0,
                f"opd.token_fraction must be in (0, 1] (1 keeps every token), got {self.token_fraction}")
        for name in ("teacher_tensor_parallel_size", "teacher_pipeline_parallel_size"):
            value = getattr(self, name)
            require(value is None or value >= 1, f"opd.{name} must be >= 1 or null, got {value}")
        require(self.teacher_url is None or self.teacher_layout is None,
                f"opd.teacher_url ({self.teacher_url}) and opd.teacher_tensor/pipeline_parallel_size both pick the "
                f"teacher: set the URL of a running server, or the layout of one the trainer starts, not both")

    @property
    def teacher_layout(self) -> tuple[int, int] | None:
        """(tp, pp) of the teacher server the trainer starts, or None when it starts none."""
        if self.teacher_tensor_parallel_size is None and self.teacher_pipeline_parallel_size is None:
            return None
        return self.teacher_tensor_parallel_size or 1, self.teacher_pipeline_parallel_size or 1


# The built-in algorithms' sections (their `config_sections`, which a test holds to this), registered with the
# config package so that loading a config or `--help` needs no algorithm imported. Every algorithm reads kl (its
# estimator) and opd (whose teacher settings it refuses unless it has a teacher), so these are always registered.
BUILT_IN_SECTIONS: dict[str, type] = {"armor": MixedRatioConfig, "kl": KLConfig, "mipu": MipuConfig, "opd": OpdConfig}
register_sections(BUILT_IN_SECTIONS)
