"""Rules between sections that hold for every algorithm (the chosen algorithm checks its own rules when it is
built, megatron_armor.algorithms; each section checks its own fields)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_armor.config.base import require

if TYPE_CHECKING:
    from megatron_armor.config.root import ArmorConfig


def check_cross_section(cfg: ArmorConfig) -> None:
    """Raise ConfigError naming the fields of the first rule `cfg` breaks."""
    t, max_new_tokens = cfg.train, cfg.rollout.sampling.max_new_tokens
    require(cfg.reward.overlong_buffer_for(max_new_tokens) <= max_new_tokens,
            f"reward.overlong_buffer ({cfg.reward.overlong_buffer}) must be <= rollout.sampling.max_new_tokens "
            f"({max_new_tokens})")
    require(t.subspace_capture_step == 0 or t.subspace_mode == "gradient" or cfg.model.params_dtype == "float32",
            "train.subspace_mode update needs model.params_dtype float32 (with bf16 the optimizer steps fp32 copies)")
    require(t.subspace_capture_step == 0 or cfg.parallel.expert_parallel_size == 1,
            f"train.subspace_capture_step does not work with parallel.expert_parallel_size "
            f"({cfg.parallel.expert_parallel_size}) > 1 yet: its bases are checkpointed by the first data-parallel "
            f"rank only, which holds other experts than the rest of its expert-parallel group")
    dp = cfg.parallel.data_parallel_size
    for refused, name in ((t.subspace_capture_step > 0, "train.subspace_capture_step"),
                          (cfg.rollout.memory.offload_trainer, "rollout.memory.offload_trainer")):
        require(not (refused and t.use_distributed_optimizer),
                f"train.use_distributed_optimizer does not work with {name} yet (they read or move the whole "
                f"optimizer state, which the distributed optimizer shards): set train.use_distributed_optimizer false")
    keep_best, every, eval_every = cfg.checkpoint.keep_best, cfg.checkpoint.every, cfg.eval.every
    require(keep_best is None or (eval_every > 0 and every % eval_every == 0),
            f"checkpoint.keep_best {keep_best} needs a validation at every checkpoint: checkpoint.every ({every}) must "
            f"be a multiple of eval.every ({eval_every}), and eval.every > 0")
    require(not cfg.monitor.anchors or keep_best is not None,
            "monitor.actions: anchor restarts from the best checkpoint: set checkpoint.keep_best (e.g. val/accuracy)")
    require(not cfg.rollout.partial_rollouts or t.routing_replay != "rollout",
            "rollout.partial_rollouts continues a response under new weights, which route the tokens they re-read "
            "otherwise than the weights that sampled them: train.routing_replay rollout (R3) would replay a mix of "
            "both; use routing_replay recompute (R2) or none with partial rollouts")
    require(cfg.parallel.context_parallel_size == 1 or not t.pack_sequences,
            f"parallel.context_parallel_size ({cfg.parallel.context_parallel_size}) does not split packed "
            f"micro-batches yet: set train.pack_sequences false")
    require(t.mini_batch_size % dp == 0,
            f"train.mini_batch_size ({t.mini_batch_size}) must be divisible by parallel.data_parallel_size ({dp}) so "
            f"every data-parallel rank trains on the same number of prompts")
    if cfg.task.synthetic is None:
        require(cfg.model.path is not None,
                "model.path is required (an HF checkpoint directory) unless task.synthetic is set")
        require(cfg.data.train_path is not None, "data.train_path is required unless task.synthetic is set")


def resolve_distributed_optimizer(cfg: ArmorConfig) -> bool:
    """train.use_distributed_optimizer as the run uses it: the value if set, else on when parallel.data_parallel_size
    > 1 and neither subspace-constrained training nor trainer offload (which do not support it yet) is on."""
    if cfg.train.use_distributed_optimizer is not None:
        return cfg.train.use_distributed_optimizer
    return (cfg.parallel.data_parallel_size > 1 and cfg.train.subspace_capture_step == 0
            and not cfg.rollout.memory.offload_trainer)
