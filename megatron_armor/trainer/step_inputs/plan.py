"""`StepPlan`: the algorithm and batch geometry of an RL step, derived from the config once."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_armor.algorithms import Algorithm
from megatron_armor.config import ArmorConfig
from megatron_armor.scoring.micro_batches import MicroBatching, sequence_multiple
from megatron_armor.scoring.routes import REPLAY_MODES, ReplayMode


@dataclass(frozen=True)
class StepPlan:
    """What every RL step does: the algorithm object (what it needs, its loss and hooks) and the batch geometry.

    It joins the train, rollout and algorithm sections with the algorithm object, which fixes some of them (actor_n:
    `Algorithm.on_policy_samples`): the step's phases read one plan, and the anchor action swaps the whole plan
    when it switches the algorithm (trainer/guard/anchor_switch.py).
    """

    algorithm: Algorithm
    train_batch_size: int  # prompts per step
    mini_batch_size: int  # prompts per optimizer step
    micro_batching: MicroBatching  # how a rank's mini-batch is cut into forward/backward micro-batches
    actor_n: int  # on-policy samples per prompt
    ref_n: int  # anchor samples per prompt (algorithms that use anchors)
    max_num_gen_batches: int
    allow_partial_batch: bool
    adv_eps: float
    ref_reset_period: int
    seed: int
    advantage_baseline: str = "mean"  # "mean" (GRPO) | "quantile" (QAE): b of A = (R - b) / (std + eps)
    baseline_quantile: float = 0.45
    nonfinite_rollback: bool = True  # undo a non-finite step's earlier mini-batches (train.nonfinite_rollback)
    routing_replay: ReplayMode = REPLAY_MODES["none"]  # MoE: whose routing the actor's forwards replay
    rollout_mode: str = "sync"  # when rollouts run (rollout.mode; trainer/rollouts/rollout_schedule.py)
    max_steps: int | None = None  # RL steps of the run (train.max_steps): no rollout is generated ahead past them
    max_staleness: int = 1  # rollout.mode async: weight versions a trained sample may lag (rollout.max_staleness)
    async_buffer_batches: int = 2  # rollout.mode async: generation batches generated ahead (rollout.async_buffer_*)
    partial_rollouts: bool = False  # rollout.mode async: a push interrupts generations, continued after it

    @classmethod
    def from_config(cls, cfg: ArmorConfig, algorithm: Algorithm) -> StepPlan:
        """The plan of `algorithm` with the train, rollout and algorithm sections' geometry and group settings."""
        section, train = cfg.algorithm, cfg.train
        return cls(
            algorithm=algorithm, train_batch_size=train.train_batch_size, mini_batch_size=train.mini_batch_size,
            micro_batching=MicroBatching(cfg.micro_batching, sequence_multiple(cfg.parallel.tensor_parallel_size)),
            actor_n=algorithm.on_policy_samples(cfg.rollout.sampling), ref_n=cfg.rollout.anchors.ref_n,
            max_num_gen_batches=section.max_num_gen_batches,
            allow_partial_batch=section.allow_partial_batch, adv_eps=section.adv_eps,
            ref_reset_period=section.ref_reset_period, seed=train.seed, advantage_baseline=section.advantage_baseline,
            baseline_quantile=section.baseline_quantile, nonfinite_rollback=train.nonfinite_rollback,
            routing_replay=REPLAY_MODES[train.routing_replay], rollout_mode=cfg.rollout.mode, max_steps=train.max_steps,
            max_staleness=cfg.rollout.max_staleness, async_buffer_batches=cfg.rollout.async_buffer_batches,
            partial_rollouts=cfg.rollout.partial_rollouts,
        )

    @property
    def old_logprobs_from_update(self) -> bool:
        """The update's own forward gives the old-policy logprobs (`Algorithm.old_logprobs_from_update`)."""
        return self.algorithm.old_logprobs_from_update(self.train_batch_size // self.mini_batch_size)

    def resets_reference_after(self, step: int) -> bool:
        """Whether RL step `step` (0-based) ends with a reference reset (every `ref_reset_period` steps)."""
        return bool(self.ref_reset_period) and (step + 1) % self.ref_reset_period == 0
