"""The post-update gate (MIPU Step 2, mipu.md §3, Algorithm 1): measure the inference gap of the synced
engine on held-out prompts and accept the update or have the trainer roll it back (`TrainingSnapshot`).

Every rank runs the same gate on the same data: held-out samples are generated round-robin and
all-gathered, the trainer scores the whole gate batch on every data-parallel rank, and rank 0's
T_post is broadcast so that every rank takes the same accept/rollback decision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_armor.algorithms import (
    GateSettings, accept_update, gap_proxy, tolerance, trajectory_advantages, trajectory_members, trajectory_owners,
)
from megatron_armor.data.datasets import PromptRow, PromptSampler
from megatron_armor.rollout.base import RolloutEngine, SamplingParams
from megatron_armor.scoring.batch import build_sequence_batch
from megatron_armor.scoring.logprobs import ScoringConfig, compute_logprobs
from megatron_armor.scoring.micro_batches import MicroBatching
from megatron_armor.trainer.rollouts.samples import SampleScorer, generate_samples


@dataclass(frozen=True)
class GateResult:
    gap: float  # T_post
    tolerance: float  # c_t
    accepted: bool
    reward_mean: float  # of the held-out responses


class InferenceGapGate:
    """Measures T_post of the just-synced engine against the trainer and decides acceptance."""

    def __init__(
        self, config: GateSettings, held_out: list[PromptRow], scorer: SampleScorer, sampling: SamplingParams, *,
        seed: int, adv_eps: float,
    ) -> None:
        """The gate over `held_out` prompts (the validation rows), with its own resumable sampler of them (seeded by
        `seed` + 1). The rule that ties the algorithm's gate to the validation set (enough held-out prompts) lives
        here, with the component that needs both."""
        if len(held_out) < config.gate_prompts:
            raise ValueError(
                f"the update gate needs mipu.gate_prompts ({config.gate_prompts}) held-out prompts, the validation set has "
                f"{len(held_out)}; set data.val_path, lower mipu.gate_prompts, or set mipu.gate=false"
            )
        self.config, self.scorer, self.sampling = config, scorer, sampling
        self.prompts = PromptSampler(held_out, config.gate_prompts, seed=seed + 1)
        self.seed, self.adv_eps = seed, adv_eps
        self.rollbacks = 0  # cumulative

    def measure(
        self, step: int, actor: torch.nn.Module, engine: RolloutEngine, *, pad_token_id: int,
        micro_batching: MicroBatching, scoring: ScoringConfig,
    ) -> GateResult:
        """Collective over all ranks: sample the held-out batch from `engine` (mu_{k+1}), score it with
        `actor` (pi_{k+1}) and compare T_post with -c_step."""
        config = self.config
        samples = generate_samples(
            engine, self.prompts.next_batch(), config.gate_n, self.sampling, self.scorer, is_anchor=False,
            seed=(self.seed, step, "mipu_gate"),
        )
        groups = [sample.prompt_index for sample in samples]
        # A trajectory forked into several samples counts once: in its group's advantages, the reward mean and T_post.
        members = trajectory_members(samples, groups)
        advantages = trajectory_advantages(samples, groups, eps=self.adv_eps)
        rewards = torch.tensor([samples[m[0]].reward for m in members], dtype=torch.float32)
        batch = build_sequence_batch(samples, advantages.tolist(), pad_token_id=pad_token_id)
        trainer_logp = compute_logprobs(actor, batch, micro_batching=micro_batching, scoring=scoring).logprobs
        gap = _from_rank0(gap_proxy(trainer_logp, batch.engine_logprobs, batch.response_mask, advantages,
                                    trajectories=trajectory_owners(members, len(samples))))
        c = tolerance(step, config.c_start, config.c_end, config.ramp_steps)
        return GateResult(gap=gap, tolerance=c, accepted=accept_update(gap, c), reward_mean=float(rewards.mean()))

    def record_rollback(self) -> None:
        """Count a rejected update that the trainer rolled back (the `rollbacks` metric and state)."""
        self.rollbacks += 1

    def state_dict(self) -> dict:
        return {"prompts": self.prompts.state_dict(), "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict) -> None:
        self.prompts.load_state_dict(state["prompts"])
        self.rollbacks = state["rollbacks"]


def _from_rank0(value: float) -> float:
    """Rank 0's value on every rank (one decision for the whole job)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        value = box[0]
    return value
