"""`optimizer`: Megatron's Adam with decoupled weight decay, global grad-norm clipping and the per-RL-step warmup.

The section is what `trainer.update.optimizer.wrap_for_training` builds the optimizer from and what its
`learning_rate` reads the schedule from; no other class repeats its fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_armor.config.base import doc, require, require_at_least
from megatron_armor.config.builders import Buildable
from megatron_armor.config.rollout import MemoryHandoffConfig
from megatron_armor.config.sections import ParallelConfig
from megatron_armor.config.subspace import SubspaceConfig


@dataclass
class OptimizerConfig(Buildable):
    """Adam hyper-parameters and the learning-rate schedule (ARMOR recipe defaults: lr 1e-6, 10 warmup RL steps,
    weight decay 0.1, clip 1.0)."""

    component = "megatron_armor.trainer.update.optimizer:wrap_for_training"

    lr: float = doc(1e-6, "peak learning rate")
    warmup_steps: int = doc(
        10, "linear warmup over this many RL steps (all mini-batches of step k use lr * min(1, (k + 1) / "
        "warmup_steps), as verl's per-RL-step scheduler), then constant"
    )
    weight_decay: float = doc(0.1, "AdamW weight decay")
    adam_beta1: float = doc(0.9, "Adam beta1")
    adam_beta2: float = doc(0.999, "Adam beta2")
    adam_eps: float = doc(1e-8, "Adam epsilon")
    grad_clip: float = doc(1.0, "global gradient-norm clip")
    use_distributed_optimizer: bool | None = doc(
        None, "Megatron's distributed optimizer: Adam state (and a bf16 model's fp32 master weights) sharded over "
        "the data-parallel x context-parallel ranks (which hold the same weights), so each keeps 1/(DP x CP) of it; "
        "unset: on when parallel.data_parallel_size > 1 unless subspace-constrained training or "
        "rollout.memory.offload_trainer is on (they do not support it yet)"
    )

    def __post_init__(self) -> None:
        require_at_least("optimizer", self, ("warmup_steps",), 0)
        require(self.lr >= 0, f"optimizer.lr must be >= 0 (0: the weights never change), got {self.lr}")
        require(self.grad_clip >= 0, f"optimizer.grad_clip must be >= 0, got {self.grad_clip}")
        require(0 <= self.weight_decay, f"optimizer.weight_decay must be >= 0, got {self.weight_decay}")

    def check_with(self, subspace: SubspaceConfig, memory: MemoryHandoffConfig) -> None:
        """The distributed optimizer shards the state that subspace-constrained training and trainer offload
        (rollout.`memory`) read or move whole: a set use_distributed_optimizer must not meet them."""
        for refused, name in ((subspace.enabled, "subspace.capture_step"),
                              (memory.offload_trainer, "rollout.memory.offload_trainer")):
            require(not (refused and self.use_distributed_optimizer),
                    f"optimizer.use_distributed_optimizer does not work with {name} yet (they read or move the whole "
                    f"optimizer state, which the distributed optimizer shards): set optimizer.use_distributed_optimizer "
                    f"false")

    def distributed(self, parallel: ParallelConfig, subspace: SubspaceConfig, memory: MemoryHandoffConfig) -> bool:
        """use_distributed_optimizer as the run uses it (a runtime value: it depends on three other sections): the
        value if set, else on when parallel.data_parallel_size > 1 and neither subspace-constrained training nor
        trainer offload (rollout.`memory`), which do not support it yet, is on."""
        if self.use_distributed_optimizer is not None:
            return self.use_distributed_optimizer
        return parallel.data_parallel_size > 1 and not subspace.enabled and not memory.offload_trainer
