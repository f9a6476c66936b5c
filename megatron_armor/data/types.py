"""Data types passed between rollout, reward, grouping and training."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

FinishReason = Literal["stop", "length"]  # why a sample's generation ended (an aborted one is retried or continued)


@dataclass
class Sample:
    """A scored completion of one prompt.

    prompt_index identifies the prompt within a generation batch (the GRPO group key).
    response_ids: [R] token ids; engine_logprobs: [R] float, the rollout engine's sampling logprobs.
    reward is the training reward including any overlong penalty; correct is the verifier's flag,
    which (not the reward) drives prompt filtering.
    routed_experts: [P + R - 1, L, k] int32, the experts the engine routed each token it fed to (the prompt, then
    every response token but the last) in each of the L decoder layers (SGLang's `routed_experts`), or None.
    token_versions: [R] int, the weight version that sampled each response token (rollout.partial_rollouts: a
    response continued under newer weights mixes versions), or None: the rollout's version of the sample's group.
    loss_mask: [R] int, 1 where the policy sampled the response token (a multi-turn trajectory's response also holds
    tool results and template scaffolding, which are not trained; agentic/trajectory.py), or None: every response
    token was sampled. engine_logprobs are 0.0 where it is 0.
    trajectory: the number of the request the sample answers in its generation call (`generate_samples`: prompt-major,
    unique within the call), or None: a trajectory of its own. Samples of one group with the same `is_anchor` and
    `trajectory` are the segments of one trajectory (a multi-turn rollout forked on drift, rollout.agentic.on_drift
    fork), in order: they carry its reward and count once in the group's statistics (`algorithms.trajectory_members`).
    """

    prompt_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    engine_logprobs: list[float]
    finish_reason: FinishReason
    is_anchor: bool
    reward: float = 0.0
    correct: bool = False
    routed_experts: torch.Tensor | None = field(default=None, compare=False)
    token_versions: list[int] | None = None
    loss_mask: list[int] | None = None
    trajectory: int | None = None
