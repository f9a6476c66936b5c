"""`StepPlan`: the algorithm and the settings of an RL step, joined once when the run is built."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_armor.algorithms import Algorithm
from megatron_armor.config import AlgorithmConfig, RolloutConfig, TrainConfig
from megatron_armor.scoring.micro_batches import MicroBatching
from megatron_armor.scoring.routes import REPLAY_MODES, ReplayMode


@dataclass(frozen=True)
class StepPlan:
    """What every RL step does: the algorithm object (what it needs, its loss and hooks) and the sections it runs by.

    It holds the train section (batch geometry: `train.train_batch_size` prompts per step, `train.mini_batch_size`
    per optimizer step; seed, step count, non-finite rollback), the rollout section (`rollout.mode` and its async
    settings, `rollout.anchors.ref_n` anchor samples per prompt), the algorithm section (group collection and
    advantages: `algorithm_section.max_num_gen_batches`, `adv_eps`, `ref_reset_period`, ...) as they were loaded,
    and the `MicroBatching` built from the micro_batching section for this run's tensor-parallel size. The step's
    phases read the sections' fields there; what the plan derives is a property.

    `actor_n` is the one value fixed when the run is built: the on-policy samples per prompt, which the run's
    algorithm decides (`Algorithm.on_policy_samples(rollout.sampling)`), so the anchor action, which swaps the
    algorithm object (trainer/guard/anchor_switch.py), keeps the run's groups' on-policy samples.
    """

    algorithm: Algorithm
    train: TrainConfig
    rollout: RolloutConfig
    algorithm_section: AlgorithmConfig  # the `algorithm` section (the `algorithm` field is the object it built)
    micro_batching: MicroBatching  # how a rank's mini-batch is cut into forward/backward micro-batches
    actor_n: int  # on-policy samples per prompt

    @property
    def routing_replay(self) -> ReplayMode:
        """MoE: whose routing the actor's forwards replay (train.routing_replay's mode)."""
        return REPLAY_MODES[self.train.routing_replay]

    @property
    def old_logprobs_from_update(self) -> bool:
        """The update's own forward gives the old-policy logprobs (`Algorithm.old_logprobs_from_update`)."""
        return self.algorithm.old_logprobs_from_update(self.train.train_batch_size // self.train.mini_batch_size)

    def resets_reference_after(self, step: int) -> bool:
        """Whether RL step `step` (0-based) ends with a reference reset (every algorithm.ref_reset_period steps)."""
        period = self.algorithm_section.ref_reset_period
        return bool(period) and (step + 1) % period == 0
