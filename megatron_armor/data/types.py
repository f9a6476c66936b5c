"""Data types passed between rollout, reward, grouping and training."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length"]  # why an engine stopped a generation (SGLang's "abort" is retried)


@dataclass
class Sample:
    """A scored completion of one prompt.

    prompt_index identifies the prompt within a generation batch (the GRPO group key).
    response_ids: [R] token ids; engine_logprobs: [R] float, the rollout engine's sampling logprobs.
    reward is the training reward including any overlong penalty; correct is the verifier's flag,
    which (not the reward) drives prompt filtering.
    """

    prompt_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    engine_logprobs: list[float]
    finish_reason: FinishReason
    is_anchor: bool
    reward: float = 0.0
    correct: bool = False
