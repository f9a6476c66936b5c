"""The batch's agent/* metrics, against sums done by hand."""

from __future__ import annotations

import pytest

from megatron_armor.agentic.metrics import AgentCounts, agent_metrics
from megatron_armor.agentic.trajectory import Segment, Status, Trajectory, TrajectoryStats


def trajectory(status, segments, stats, final=True, turn_rewards=()):
    return Trajectory({}, segments, status, 0.0, list(turn_rewards), [], stats, final)


def batch():
    a = trajectory(Status.COMPLETED, [Segment([1, 2, 3, 4], [0, 1, 0, 1], [0, -1, 0, -1])],
                   TrajectoryStats(turns=2, tool_calls=3, tool_errors=1, generation_s=1.0, tool_s=3.0))
    b = trajectory(Status.FAILED, [Segment([1, 2], [0, 1], [0, -1]), Segment([5, 6, 7], [0, 0, 1], [0, 0, -1])],
                   TrajectoryStats(turns=2, tool_calls=1, generation_s=2.0, drift_turns=1), final=False,
                   turn_rewards=[0.5, -0.25])
    c = trajectory(Status.FAILED, [], TrajectoryStats(), final=None)
    return [a, b, c]


def test_agent_metrics_are_batch_means_and_fractions():
    metrics = agent_metrics(batch())
    assert metrics == pytest.approx({
        "agent/turns_mean": 4 / 3, "agent/tool_calls_mean": 4 / 3, "agent/segments_mean": 3 / 3,
        "agent/tool_error_rate": 1 / 4,
        "agent/status_completed": 1 / 3, "agent/status_truncated": 0.0, "agent/status_aborted": 0.0,
        "agent/status_failed": 2 / 3, "agent/trainable_token_fraction": 4 / 9, "agent/generation_s_mean": 1.0,
        "agent/tool_s_mean": 1.0, "agent/drift_turn_fraction": 1 / 4, "agent/final_render_mismatch": 1 / 2,
        "agent/turn_reward_mean": (0.5 - 0.25) / 2,  # over the turns rewarded (b's): a and c gave none
    })
    assert agent_metrics([]) == {}
    a, _, c = batch()
    assert "agent/turn_reward_mean" not in agent_metrics([a, c])  # no environment gave per-turn rewards
    a.turn_rewards = [1.0, 0.1]
    assert agent_metrics([a, c])["agent/turn_reward_mean"] == pytest.approx(0.55, abs=1e-6)


def test_counts_of_parts_summed_as_vectors_give_the_whole_batch_metrics():
    """What ranks do: each counts its share, the vectors are summed, the sum's metrics are the whole batch's."""
    a, b, c = batch()
    first, second = AgentCounts(), AgentCounts()
    first.add([a, c])
    second.add([b])
    summed = AgentCounts.from_vector([x + y for x, y in zip(first.as_vector(), second.as_vector())])
    assert summed == first.merged(second)
    assert summed.statuses == [1, 0, 0, 2] and summed.generation_ms == 3000
    assert summed.metrics() == agent_metrics([a, b, c])
