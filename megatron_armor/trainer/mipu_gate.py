"""MIPU Step 2 in the trainer: snapshot before the update, measure the post-update inference gap on
held-out prompts with the synced engine, accept or roll back (mipu.md §3, Algorithm 1).

Every rank runs the same gate on the same data: held-out samples are generated round-robin and
all-gathered, the trainer scores the whole gate batch on every data-parallel rank, and rank 0's
T_post is broadcast so that every rank takes the same accept/rollback decision.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_armor.algorithms import UpdateGateConfig, accept_update, gap_proxy, group_advantages, tolerance
from megatron_armor.data.datasets import PromptRow, PromptSampler
from megatron_armor.diagnostics.subspace import SubspaceConstraint
from megatron_armor.rollout.base import RolloutEngine, SamplingParams
from megatron_armor.scoring.batch import build_sequence_batch
from megatron_armor.scoring.logprobs import ScoringConfig, compute_logprobs
from megatron_armor.trainer.samples import SampleScorer, generate_samples


@dataclass
class TrainingSnapshot:
    """theta_k and Omega_k of this rank: parameter copies, a deep copy of the Megatron optimizer state
    (Adam moments and step counts, fp32 master weights for bf16 models), the optimizer-step counter and
    the subspace constraint's state (its counters; W0 and the bases are never changed in place)."""

    params: list[torch.Tensor]
    optimizer_state: dict
    optimizer_steps: int
    constraint_state: dict | None = None

    @classmethod
    def capture(
        cls, ddp: torch.nn.Module, optimizer, optimizer_steps: int, constraint: SubspaceConstraint | None = None, *,
        to_host: bool = False,
    ) -> TrainingSnapshot:
        """Copy the state; `to_host` keeps the copies in CPU memory (a GPU shared with colocated servers)."""
        device = torch.device("cpu") if to_host else None
        return cls(
            params=[p.detach().to(device, copy=True) for p in ddp.module.parameters()],
            optimizer_state=_copy_tensors(optimizer.state_dict(), device),
            optimizer_steps=optimizer_steps,
            constraint_state=None if constraint is None else constraint.state_dict(),
        )

    @torch.no_grad()
    def restore(self, ddp: torch.nn.Module, optimizer, constraint: SubspaceConstraint | None = None) -> None:
        """Put the weights, optimizer state and constraint state back bit for bit (the snapshot stays reusable)."""
        for param, saved in zip(ddp.module.parameters(), self.params, strict=True):
            param.copy_(saved)
        optimizer.load_state_dict(copy.deepcopy(self.optimizer_state))
        if constraint is not None:
            constraint.load_state_dict(self.constraint_state)


def _copy_tensors(tree, device: torch.device | None):
    """A deep copy of a state-dict tree whose tensors are copied to `device` (None: where they are)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to(device, copy=True)
    if isinstance(tree, dict):
        return {key: _copy_tensors(value, device) for key, value in tree.items()}
    if type(tree) in (list, tuple):
        return type(tree)(_copy_tensors(value, device) for value in tree)
    return copy.deepcopy(tree)


@dataclass(frozen=True)
class GateResult:
    gap: float  # T_post
    tolerance: float  # c_t
    accepted: bool
    reward_mean: float  # of the held-out responses


class InferenceGapGate:
    """Measures T_post of the just-synced engine against the trainer and decides acceptance."""

    def __init__(
        self, config: UpdateGateConfig, prompts: PromptSampler, scorer: SampleScorer, sampling: SamplingParams, *,
        seed: int, adv_eps: float,
    ) -> None:
        self.config, self.prompts, self.scorer, self.sampling = config, prompts, scorer, sampling
        self.seed, self.adv_eps = seed, adv_eps
        self.rollbacks = 0  # cumulative

    @classmethod
    def from_config(
        cls, config: UpdateGateConfig, held_out: list[PromptRow], scorer: SampleScorer, sampling: SamplingParams, *,
        seed: int, adv_eps: float,
    ) -> InferenceGapGate:
        """The gate over `held_out` prompts (the validation rows), with its own resumable sampler of them."""
        if len(held_out) < config.prompts:
            raise ValueError(
                f"the update gate needs mipu.gate_prompts ({config.prompts}) held-out prompts, the validation set has "
                f"{len(held_out)}; set data.val_path, lower mipu.gate_prompts, or set mipu.gate=false"
            )
        return cls(config, PromptSampler(held_out, config.prompts, seed=seed + 1), scorer, sampling, seed=seed,
                   adv_eps=adv_eps)

    def measure(
        self, step: int, actor: torch.nn.Module, engine: RolloutEngine, *, pad_token_id: int, micro_batch_size: int,
        scoring: ScoringConfig,
    ) -> GateResult:
        """Collective over all ranks: sample the held-out batch from `engine` (mu_{k+1}), score it with
        `actor` (pi_{k+1}) and compare T_post with -c_step."""
        config = self.config
        samples = generate_samples(
            engine, self.prompts.next_batch(), config.responses_per_prompt, self.sampling, self.scorer, is_anchor=False,
            seed=(self.seed, step, "mipu_gate"),
        )
        group_ids = torch.tensor([sample.prompt_index for sample in samples])
        rewards = torch.tensor([sample.reward for sample in samples], dtype=torch.float32)
        advantages = group_advantages(rewards, group_ids, eps=self.adv_eps)
        batch = build_sequence_batch(samples, advantages.tolist(), pad_token_id=pad_token_id)
        trainer_logp = compute_logprobs(actor, batch, micro_batch_size=micro_batch_size, scoring=scoring).logprobs
        gap = _from_rank0(gap_proxy(trainer_logp, batch.engine_logprobs, batch.response_mask, advantages))
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
