"""Every config rule and default that depends on `algorithm.name`, in one place.

These compare the name for now; each belongs to its algorithm and moves into the registered algorithm
objects (defaults of the loss, what the algorithm needs of rollouts, anchors and the OPD teacher).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_armor.config.base import require

if TYPE_CHECKING:
    from megatron_armor.config.root import ArmorConfig

BUILT_IN_ALGORITHMS = ("armor", "grpo", "grpo_kl", "mipu", "opd")


def default_clip_high(name: str, clip_low: float) -> float:
    """PPO clip epsilon above 1 when `algorithm.clip_high` is unset: clip_low for mipu (symmetric, mipu.md §2),
    0.28 otherwise."""
    return clip_low if name == "mipu" else 0.28


def default_dual_clip(name: str, clip_low: float) -> float:
    """Dual-clip constant when `algorithm.dual_clip` is unset: 1 + 2 clip_low for mipu, 10 otherwise."""
    return 1.0 + 2.0 * clip_low if name == "mipu" else 10.0


def default_aggregation(name: str) -> str:
    """Policy-loss reduction when `algorithm.loss_aggregation` is unset: seq_mean_token_mean for mipu (J_S1),
    token_mean otherwise."""
    return "seq_mean_token_mean" if name == "mipu" else "token_mean"


def check_algorithm_rules(cfg: ArmorConfig) -> None:
    """The rules that tie the other sections to `algorithm.name`; each error names the fields and what to set."""
    a = cfg.algorithm
    require(a.name in BUILT_IN_ALGORITHMS,
            f"algorithm.name: {a.name!r} is not allowed; choose one of {list(BUILT_IN_ALGORITHMS)}")
    clip_high, dual_clip = a.effective_clip_high, a.effective_dual_clip
    require(a.clip_low >= 0 and clip_high >= 0,
            f"algorithm.clip_low/clip_high must be >= 0, got {a.clip_low}/{clip_high}")
    require(dual_clip > 1, f"algorithm.dual_clip must be > 1, got {dual_clip}")
    _check_opd(cfg)
    _check_group_shape(cfg)


def _check_opd(cfg: ArmorConfig) -> None:
    """OPD's fields are unset unless algorithm.name is opd; opd needs a teacher, and its off-policy variant the
    ratio clip off and an in-process teacher engine."""
    a, o = cfg.algorithm, cfg.opd
    require(o.token_fraction == 1.0 or a.name == "opd",
            f"opd.token_fraction ({o.token_fraction}) sparsifies opd's per-token advantages; "
            f"{a.name} has none: leave it at 1.0")
    require(a.name == "opd" or (o.teacher_url is None and o.teacher_layout is None),
            f"opd.teacher_url / teacher_*_parallel_size configure the OPD teacher; {a.name} has none: unset them")
    synthetic_teacher = cfg.task.synthetic is not None and cfg.task.warm_start_steps > 0
    if a.name == "opd":
        require(o.teacher_layout is None or o.teacher_path is not None or cfg.task.synthetic is not None,
                "opd.teacher_tensor/pipeline_parallel_size start a teacher server of opd.teacher_path: set "
                "opd.teacher_path (or opd.teacher_url for a server that runs already)")
        require(o.teacher_url is not None or o.teacher_path is not None or synthetic_teacher,
                "opd.teacher_path is required for algorithm.name opd (an HF checkpoint dir of the teacher; the "
                "synthetic task with task.warm_start_steps > 0 uses its warm start), or opd.teacher_url")
        if o.rollouts == "teacher":
            clip_high = a.effective_clip_high
            require(a.clip_low == 1.0 and clip_high == 1.0,
                    f"opd.rollouts teacher trains on off-policy tokens with the PPO ratio clip off (eps = "
                    f"1.0, opd.md §1): set algorithm.clip_low=1.0 algorithm.clip_high=1.0, got "
                    f"{a.clip_low}/{clip_high}")
            require(cfg.rollout.backend == "local",
                    "opd.rollouts teacher samples from an in-process engine of opd.teacher_path; "
                    "rollout.backend sglang has no teacher rollout servers: use rollout.backend local, or "
                    "opd.rollouts student")
            require(o.teacher_path is not None or synthetic_teacher,
                    "opd.rollouts teacher needs the teacher's weights in the trainer for its rollout engine: "
                    "set opd.teacher_path (an HF checkpoint dir; opd.teacher_url alone only scores)")
    require(a.name == "opd" or o.rollouts == "student",
            f"opd.rollouts ({o.rollouts}) picks who samples opd's training responses; {a.name} samples "
            f"from the actor: leave it at student")


def _check_group_shape(cfg: ArmorConfig) -> None:
    """ARMOR's groups are actor_n on-policy samples + 1 anchor; the others' are all on-policy, with no anchors."""
    a, s, anchors, r = cfg.algorithm, cfg.rollout.sampling, cfg.rollout.anchors, cfg.rollout
    if a.name == "armor":
        require(s.actor_n == s.n_samples - 1,
                f"rollout.sampling.actor_n must be rollout.sampling.n_samples - 1 = {s.n_samples - 1} for armor "
                f"(groups are actor_n on-policy samples + 1 anchor), got {s.actor_n}")
        require(anchors.ref_n >= 1, f"rollout.anchors.ref_n must be >= 1 for armor, got {anchors.ref_n}")
    else:
        require(s.actor_n == s.n_samples,
                f"rollout.sampling.actor_n must equal rollout.sampling.n_samples ({s.n_samples}) for {a.name}, got "
                f"{s.actor_n}")
        require(anchors.engine == "separate" and not anchors.cache,
                f"rollout.anchors.engine ({anchors.engine}) and rollout.anchors.cache ({anchors.cache}) apply to "
                f"armor's anchors; {a.name} samples none: leave them at separate / false")
    require(r.backend != "sglang" or a.name != "armor" or anchors.engine == "shared" or bool(r.sglang.ref_urls),
            "rollout.sglang.ref_urls is required for armor with rollout.backend sglang (servers of the reference "
            "policy), or set rollout.anchors.engine shared to sample anchors from the actor's servers")
