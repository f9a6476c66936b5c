"""Token-exact trajectories: what a multi-turn rollout trains on, built turn by turn from the engine's own tokens.

A trajectory is one or more `Segment`s, each a token sequence the trainer sees as one sample. The policy's sampled
tokens enter a segment exactly as the engine returned them (loss mask 1, the engine's logprobs); everything else (the
first prompt, the template's scaffolding, tool results, other messages) enters with mask 0. The next turn's prompt
is the segment so far: previous prompt + sampled tokens + the template's delta (`render.ChatRenderer.continuation`).

Drift policy. After every turn the segment is compared with the canonical ids of the conversation (its full render,
encoded at once, `ChatRenderer.ids`):
- equal: clean;
- equal up to the last sampled token, different after it (the delta tokenized differently on its own than in the
  full render): realign: the canonical tail replaces the delta, the engine samples the next turn from it;
- different earlier (re-encoding the decoded sampled text gives other ids, or the template rewrote history, e.g.
  stripped earlier `<think>` reasoning): drift, handled by `on_drift`:
  - "keep": the segment goes on token-exact; the policy keeps seeing its own earlier tokens (and reasoning);
  - "fork": a new segment starts from the canonical ids (mask 0); the earlier segment keeps its sampled tokens.
    With a template that strips reasoning this forks at every turn after one that reasoned (Qwen 3's practice).
Either way every sampled token is trained exactly once, in the segment whose prompt it was sampled from. At the end
`finish` checks the last segment against the full render of the finished conversation (a prefix: the render also
closes the last turn) and records the outcome; nothing ever raises on drift.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

DriftPolicy = Literal["keep", "fork"]
DRIFT_POLICIES: tuple[DriftPolicy, ...] = ("keep", "fork")


class TurnCheck(enum.Enum):
    """How a turn's delta compared with the canonical render (module docstring)."""

    CLEAN = "clean"
    REALIGN = "realign"
    DRIFT = "drift"  # kept token-exact
    FORK = "fork"


class Status(enum.Enum):
    """How a trajectory ended."""

    COMPLETED = "completed"  # the environment ended it (or the policy answered without asking for more)
    TRUNCATED = "truncated"  # a limit: turns, total tokens, or a turn cut at its token limit
    ABORTED = "aborted"  # the engine interrupted it, or too many consecutive invalid turns
    FAILED = "failed"  # the environment or a tool raised, timed out, or answered malformed messages


@dataclass
class Segment:
    """One sample of a trajectory.

    token_ids: [T] int; loss_mask: [T] int, 1 iff the policy sampled that token from this segment's prefix;
    logprobs: [T] float, the engine's logprob of each sampled token (its `Generation.logprobs`), 0.0 where masked;
    sampled_versions: [sum(loss_mask)] int, the weight version that drew each sampled token, in order (an engine
    that tracks versions: `Generation.versions`, partial rollouts), or None.
    """

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    sampled_versions: list[int] | None = None

    @classmethod
    def context(cls, token_ids: Sequence[int]) -> Segment:
        return cls(list(token_ids), [0] * len(token_ids), [0.0] * len(token_ids))

    def extend(self, token_ids: Sequence[int], logprobs: Sequence[float] | None = None,
               versions: Sequence[int] | None = None) -> None:
        """Append context tokens (`logprobs` None) or sampled ones with their logprobs (and, from an engine that
        tracks them, their weight versions: every sampled token of a segment has one, or none has)."""
        sampled = logprobs is not None
        if sampled and len(logprobs) != len(token_ids):
            raise ValueError(f"{len(token_ids)} sampled tokens but {len(logprobs)} logprobs")
        versioned = self.sampled_versions is not None
        if sampled and (self.sampled_tokens or versioned) and versioned != (versions is not None):
            raise ValueError("every sampled token of a segment has a weight version, or none has")
        if versions is not None and (not sampled or len(versions) != len(token_ids)):
            raise ValueError(f"{len(versions)} weight versions for {len(token_ids) if sampled else 0} sampled tokens")
        if versions is not None:
            self.sampled_versions = [*(self.sampled_versions or []), *versions]
        self.token_ids += token_ids
        self.loss_mask += [int(sampled)] * len(token_ids)
        self.logprobs += list(logprobs) if sampled else [0.0] * len(token_ids)

    @property
    def sampled_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def prompt_length(self) -> int:
        """Tokens before the first sampled one (the segment's prompt; the rest is its response: sampled tokens and
        the context between them)."""
        return self.loss_mask.index(1) if 1 in self.loss_mask else len(self.token_ids)

    def response_versions(self) -> list[int] | None:
        """[T - prompt_length] int: the weight version of each token after the prompt, a sampled token's its own and a
        context token's that of the sampled token before it (the weights whose turn it answers); None without
        versions."""
        if self.sampled_versions is None:
            return None
        versions, drawn = [], iter(self.sampled_versions)
        for sampled in self.loss_mask[self.prompt_length:]:
            versions.append(next(drawn) if sampled else versions[-1])
        return versions

    def through_last_sampled(self) -> Segment:
        """This segment cut after its last sampled token (context the policy never answered is not trained on)."""
        end = len(self.loss_mask) - self.loss_mask[::-1].index(1) if 1 in self.loss_mask else 0
        return Segment(self.token_ids[:end], self.loss_mask[:end], self.logprobs[:end], self.sampled_versions)


@dataclass
class TrajectoryBuilder:
    """Grows a trajectory's segments turn by turn (module docstring). `prompt` is what the engine samples from next."""

    prompt_ids: Sequence[int]
    on_drift: DriftPolicy = "keep"
    segments: list[Segment] = field(init=False)
    checks: list[TurnCheck] = field(init=False, default_factory=list)
    final_render_matches: bool | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.on_drift not in DRIFT_POLICIES:
            raise ValueError(f"on_drift must be one of {DRIFT_POLICIES}, got {self.on_drift!r}")
        if not self.prompt_ids:
            raise ValueError("a trajectory needs a non-empty first prompt")
        self.segments = [Segment.context(self.prompt_ids)]

    @property
    def prompt(self) -> list[int]:
        return list(self.segments[-1].token_ids)

    @property
    def total_tokens(self) -> int:
        """Tokens of the growing (last) segment: what the next generation's context holds."""
        return len(self.segments[-1].token_ids)

    def add_sampled(self, token_ids: Sequence[int], logprobs: Sequence[float],
                    versions: Sequence[int] | None = None) -> None:
        """Append a turn's sampled tokens, their logprobs and (partial rollouts) the weight version of each."""
        self.segments[-1].extend(token_ids, logprobs, versions)

    def add_context(self, continuation: Sequence[int], canonical: Sequence[int]) -> TurnCheck:
        """Append a turn's `continuation` (ids after the sampled tokens), checked against `canonical`, the ids of the
        whole conversation so far with the next generation prompt; returns what the check found."""
        segment = self.segments[-1]
        built, canonical = segment.token_ids + list(continuation), list(canonical)
        if built == canonical:
            check = TurnCheck.CLEAN
            segment.extend(continuation)
        elif canonical[:len(segment.token_ids)] == segment.token_ids:
            check = TurnCheck.REALIGN
            segment.extend(canonical[len(segment.token_ids):])
        elif self.on_drift == "fork":
            check = TurnCheck.FORK
            self.segments.append(Segment.context(canonical))
        else:
            check = TurnCheck.DRIFT
            segment.extend(continuation)
        self.checks.append(check)
        return check

    def trained_segments(self) -> list[Segment]:
        """The segments to train on: those with sampled tokens, each cut after its last one."""
        return [s.through_last_sampled() for s in self.segments if s.sampled_tokens]

    def finish(self, canonical: Sequence[int]) -> bool:
        """The final check: whether the last segment is a prefix of `canonical`, the finished conversation's full
        render (no generation prompt). Recorded in `final_render_matches`; a mismatch is reported, never raised."""
        tokens = self.segments[-1].token_ids
        self.final_render_matches = list(canonical[:len(tokens)]) == tokens
        return self.final_render_matches


@dataclass
class TrajectoryStats:
    """Counters of one trajectory, summed into the batch's `agent/*` metrics (agentic/metrics.py)."""

    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0  # tool calls that raised, timed out or could not be parsed
    generation_s: float = 0.0  # wall time awaiting the engine
    tool_s: float = 0.0  # wall time awaiting the environment's replies (tools included)
    drift_turns: int = 0  # turns whose check found drift (kept or forked)


@dataclass
class Trajectory:
    """A finished rollout of one row: what the trainer's rollout source turns into samples.

    segments: the samples (`Segment`), each sampled token in exactly one, each ending with its last sampled token
    (`TrajectoryBuilder.trained_segments`); reward: the environment's score, or the rollout function's
    (0.0 when the trajectory failed before scoring): what training uses; turn_rewards: [turns] per-turn rewards where
    the environment gave them, else empty (logged, not trained on: agentic/metrics.py); messages: the conversation;
    error: what went wrong for a failed or aborted trajectory. A rollout function of one's own builds it the same way
    (agentic/driver.py); what breaks this contract raises here.
    """

    row: dict
    segments: list[Segment]
    status: Status
    reward: float
    turn_rewards: list[float]
    messages: list[dict]
    stats: TrajectoryStats
    final_render_matches: bool | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.status, Status):
            raise ValueError(f"a trajectory's status is a Status ({', '.join(s.name for s in Status)}), got "
                             f"{self.status!r}")
        for i, s in enumerate(self.segments):
            mask = s.loss_mask
            if not len(s.token_ids) == len(mask) == len(s.logprobs) or not mask or mask[0] != 0 or mask[-1] != 1:
                raise ValueError(f"segment {i} of a trajectory must start with its prompt (context, mask 0), end with "
                                 f"a sampled token (mask 1) and give every token a mask and a logprob "
                                 f"(TrajectoryBuilder.trained_segments() gives such segments), got {len(s.token_ids)} "
                                 f"tokens, loss mask {mask[:4]}...{mask[-4:]}, {len(s.logprobs)} logprobs")

    @property
    def sampled_tokens(self) -> int:
        return sum(s.sampled_tokens for s in self.segments)

    @property
    def total_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)
