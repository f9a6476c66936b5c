"""`PolicyHandles`: the models and rollout engines of one trainer rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_armor.models.hf_config import ModelShape
from megatron_armor.rollout.base import RolloutEngine
from megatron_armor.teacher.scorer import TeacherScorer


@dataclass
class PolicyHandles:
    """The models of one rank: trainable actor (DDP + optimizer), frozen reference (and OPD teacher), and engines.

    `teacher_engine` (OPD's off-policy variant, opd.rollouts teacher) samples the training
    responses in place of the actor's engine; it holds the teacher's weights and is never synced. The
    actor's engine still serves validation and receives the actor's weights after every update.
    """

    actor: torch.nn.Module  # Megatron DDP-wrapped GPTModel
    optimizer: object  # MegatronOptimizer
    ref: torch.nn.Module  # frozen GPTModel
    shape: ModelShape
    actor_engine: RolloutEngine
    ref_engine: RolloutEngine
    pad_token_id: int
    teacher: TeacherScorer | None = None  # OPD: frozen teacher, in-process or a scoring server
    teacher_engine: RolloutEngine | None = None  # OPD off-policy variant: the teacher samples

    @property
    def training_engine(self) -> RolloutEngine:
        """The engine that samples the training responses: the actor's, or the OPD teacher's."""
        return self.actor_engine if self.teacher_engine is None else self.teacher_engine

    @property
    def shared_engine(self) -> bool:
        """One engine serves both policies (rollout.anchors.engine shared); their weights take turns in it."""
        return self.ref_engine is self.actor_engine

    def engines(self) -> list[RolloutEngine]:
        """Every distinct engine of the rank (a shared engine once), e.g. to close them."""
        engines = (self.actor_engine, self.ref_engine, self.teacher_engine)
        return list({id(e): e for e in engines if e is not None}.values())
