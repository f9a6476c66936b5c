"""A batch of trajectories' `agent/*` metrics."""

from __future__ import annotations

from collections.abc import Sequence

from megatron_armor.agentic.trajectory import Status, Trajectory


def agent_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Means over the batch's trajectories (turns, tool calls, seconds awaiting the engine and the environment),
    the fraction ending in each status, the fraction of tool calls that failed or were invalid, the fraction of
    trajectory tokens the policy sampled (trained), and those of turns with drift and of trajectories whose final
    render check failed (agentic/trajectory.py)."""
    if not trajectories:
        return {}
    n = len(trajectories)
    stats = [t.stats for t in trajectories]
    calls, turns = sum(s.tool_calls for s in stats), sum(s.turns for s in stats)
    checked = [t.final_render_matches for t in trajectories if t.final_render_matches is not None]
    return {
        "agent/turns_mean": turns / n,
        "agent/tool_calls_mean": calls / n,
        "agent/tool_error_rate": sum(s.tool_errors for s in stats) / max(calls, 1),
        **{f"agent/status_{status.value}": sum(t.status is status for t in trajectories) / n for status in Status},
        "agent/trainable_token_fraction": sum(t.sampled_tokens for t in trajectories) / max(
            sum(t.total_tokens for t in trajectories), 1),
        "agent/generation_s_mean": sum(s.generation_s for s in stats) / n,
        "agent/tool_s_mean": sum(s.tool_s for s in stats) / n,
        "agent/drift_turn_fraction": sum(s.drift_turns for s in stats) / max(turns, 1),
        "agent/final_render_mismatch": sum(not m for m in checked) / max(len(checked), 1),
    }
