"""A batch of trajectories' `agent/*` metrics, from counts that ranks can sum (`AgentCounts`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from megatron_armor.agentic.trajectory import Status, Trajectory


@dataclass
class AgentCounts:
    """Integer sums over trajectories (seconds as milliseconds, rewards as millionths), so that ranks can add theirs
    (`as_vector`).

    statuses: trajectories per `Status`, in its order; render_checks / render_mismatches: trajectories whose final
    render check ran / failed (agentic/trajectory.py); segments: the samples trajectories became (one each unless
    they forked on drift); turn_rewards / turn_reward_micros: the per-turn rewards environments gave
    (`Trajectory.turn_rewards`) and their sum."""

    trajectories: int = 0
    segments: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    sampled_tokens: int = 0
    total_tokens: int = 0
    generation_ms: int = 0
    tool_ms: int = 0
    drift_turns: int = 0
    render_checks: int = 0
    render_mismatches: int = 0
    turn_rewards: int = 0
    turn_reward_micros: int = 0
    statuses: list[int] = field(default_factory=lambda: [0] * len(Status))

    def add(self, trajectories: Iterable[Trajectory]) -> None:
        for t in trajectories:
            stats = t.stats
            self.trajectories += 1
            self.segments += len(t.segments)
            self.turns += stats.turns
            self.tool_calls += stats.tool_calls
            self.tool_errors += stats.tool_errors
            self.sampled_tokens += t.sampled_tokens
            self.total_tokens += t.total_tokens
            self.generation_ms += round(stats.generation_s * 1000)
            self.tool_ms += round(stats.tool_s * 1000)
            self.drift_turns += stats.drift_turns
            self.render_checks += t.final_render_matches is not None
            self.render_mismatches += t.final_render_matches is False
            self.turn_rewards += len(t.turn_rewards)
            self.turn_reward_micros += sum(round(r * 1e6) for r in t.turn_rewards)
            self.statuses[list(Status).index(t.status)] += 1

    def as_vector(self) -> list[int]:
        """Every count, `statuses` last: what ranks sum (`from_vector`)."""
        return [*(getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "statuses"), *self.statuses]

    @classmethod
    def from_vector(cls, vector: Sequence[int]) -> AgentCounts:
        """The counts of an `as_vector` layout (e.g. summed over ranks)."""
        scalars = [f.name for f in dataclasses.fields(cls) if f.name != "statuses"]
        return cls(**dict(zip(scalars, map(int, vector))), statuses=[int(v) for v in vector[len(scalars):]])

    def merged(self, other: AgentCounts) -> AgentCounts:
        return AgentCounts.from_vector([a + b for a, b in zip(self.as_vector(), other.as_vector(), strict=True)])

    def metrics(self) -> dict[str, float]:
        """Means over the trajectories (turns, tool calls, segments, seconds awaiting the engine and the environment),
        the fraction ending in each status, the fraction of tool calls that failed or were invalid, the fraction of
        trajectory tokens the policy sampled (trained), and those of turns with drift and of trajectories whose final
        render check failed (agentic/trajectory.py); where environments gave per-turn rewards, their mean (to 1e-6;
        logged only: training uses the trajectory's reward); {} without trajectories."""
        n = self.trajectories
        if not n:
            return {}
        turn_rewards = {"agent/turn_reward_mean": self.turn_reward_micros / 1e6 / self.turn_rewards} if (
            self.turn_rewards) else {}
        return {
            "agent/turns_mean": self.turns / n,
            "agent/tool_calls_mean": self.tool_calls / n,
            "agent/segments_mean": self.segments / n,
            "agent/tool_error_rate": self.tool_errors / max(self.tool_calls, 1),
            **{f"agent/status_{status.value}": count / n for status, count in zip(Status, self.statuses)},
            "agent/trainable_token_fraction": self.sampled_tokens / max(self.total_tokens, 1),
            "agent/generation_s_mean": self.generation_ms / 1000 / n,
            "agent/tool_s_mean": self.tool_ms / 1000 / n,
            "agent/drift_turn_fraction": self.drift_turns / max(self.turns, 1),
            "agent/final_render_mismatch": self.render_mismatches / max(self.render_checks, 1),
            **turn_rewards,
        }


def agent_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """`AgentCounts.metrics` of `trajectories` (seconds to the millisecond)."""
    counts = AgentCounts()
    counts.add(trajectories)
    return counts.metrics()
