"""`subspace`: subspace-constrained training (`diagnostics.subspace`): after an RL step, updates are confined to
the top-K span of the cumulative update so far.

The trainer's set-up builds the constraint from this section (`trainer.update.optimizer.subspace_constraint`) and
captures its bases after `capture_step`; no other class repeats its fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_armor.config.base import check_choices, doc, require, require_at_least
from megatron_armor.config.builders import Buildable
from megatron_armor.config.sections import ModelConfig, ParallelConfig


@dataclass
class SubspaceConfig(Buildable):
    """When the constraint starts, its rank K, and what it projects."""

    component = "megatron_armor.trainer.update.optimizer:run_subspace_constraint"

    capture_step: int = doc(
        0, "after this RL step, confine updates to the top-K span of the cumulative update so far (0: off)"
    )
    k: int = doc(16, "K: the rank of the subspace")
    mode: Literal["gradient", "update"] = doc(
        "gradient", "project the gradient before Adam, or the parameter change after it"
    )

    def __post_init__(self) -> None:
        check_choices("subspace", self)
        require_at_least("subspace", self, ("capture_step",), 0)
        require_at_least("subspace", self, ("k",), 1)

    @property
    def enabled(self) -> bool:
        return self.capture_step > 0

    def check_with(self, model: ModelConfig, parallel: ParallelConfig) -> None:
        """Where the constraint works: mode update on float32 weights (`model`), no expert parallelism
        (`parallel`)."""
        if not self.enabled:
            return
        require(self.mode == "gradient" or model.params_dtype == "float32",
                "subspace.mode update needs model.params_dtype float32 (with bf16 the optimizer steps fp32 copies)")
        require(parallel.expert_parallel_size == 1,
                f"subspace.capture_step does not work with parallel.expert_parallel_size "
                f"({parallel.expert_parallel_size}) > 1 yet: its bases are checkpointed by the first data-parallel "
                f"rank only, which holds other experts than the rest of its expert-parallel group")
