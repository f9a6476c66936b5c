"""A dataset's scored samples as records (one per response) and the metrics of a dataset computed from them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from statistics import mean
from typing import Any

from megatron_armor.agentic.trajectory import Trajectory
from megatron_armor.evaluation.estimators import bootstrap_stderr, maj_at_k, mean_pass_at_k
from megatron_armor.evaluation.settings import EvalDataset


@dataclass(frozen=True)
class TrajectoryRecord:
    """What a response that is a multi-turn trajectory (an agentic dataset's) adds to its record: how it ended
    (`agentic.trajectory.Status` value), the policy's turns, the tool calls the environment counted and those of them
    that failed or were invalid, and the trajectory's final answer (its last assistant message, which the dataset's
    answer_fn reads)."""

    status: str
    turns: int
    tool_calls: int
    tool_errors: int
    final_answer: str

    @classmethod
    def of(cls, trajectory: Trajectory) -> TrajectoryRecord:
        stats = trajectory.stats
        answers = [m["content"] for m in trajectory.messages if m["role"] == "assistant"]
        return cls(trajectory.status.value, stats.turns, stats.tool_calls, stats.tool_errors,
                   answers[-1] if answers else "")


@dataclass(frozen=True)
class SampleRecord:
    """One evaluated response: prompt `prompt_id` (its row's index in the dataset), sample `sample` of n; with
    `trajectory`, the response is a multi-turn trajectory: every token after its first prompt (turns, tool results,
    template scaffolding), `length` counts them all and `answer` is extracted from its final answer."""

    prompt_id: int
    sample: int
    response: str
    answer: str | None  # what the dataset's answer_fn extracted (None: nothing, or no answer_fn)
    reward: float
    correct: bool
    length: int  # response tokens, the stop token included
    finish_reason: str  # "stop" | "length" (cut at max_new_tokens) | "abort"
    trajectory: TrajectoryRecord | None = None

    def to_json(self) -> dict[str, Any]:
        """The record as one flat JSON object (a trajectory's fields beside the others; none for a completion)."""
        row = asdict(self)
        trajectory = row.pop("trajectory")
        return {**row, **(trajectory or {})}


def dataset_metrics(records: Sequence[SampleRecord], dataset: EvalDataset, *, seed: int) -> dict[str, float]:
    """The metrics of `dataset` from its `records` (prompt-major, `dataset.n` per prompt):

    avg@n (mean correctness of every sample) and avg@n_stderr (bootstrap over prompts, seeded by `seed`);
    pass@k and, with an answer_fn, maj@k for each k of `dataset.ks`; reward_mean; response_length (mean tokens);
    truncated_fraction (cut at max_new_tokens) and aborted_fraction (an interrupted engine's); for trajectories (an
    agentic dataset) `trajectory_metrics` too.
    """
    n = dataset.n
    if not records or len(records) % n:
        raise ValueError(f"dataset {dataset.name!r}: {len(records)} records are not whole groups of n = {n}")
    prompts = [records[i:i + n] for i in range(0, len(records), n)]
    correct = [[r.correct for r in group] for group in prompts]
    metrics = {
        f"avg@{n}": mean([float(r.correct) for r in records]),
        f"avg@{n}_stderr": bootstrap_stderr([mean(map(float, row)) for row in correct], seed=seed),
    }
    metrics.update({f"pass@{k}": mean_pass_at_k(correct, k) for k in dataset.ks})
    if dataset.answer_fn is not None:
        answers = [[r.answer for r in group] for group in prompts]
        metrics.update({f"maj@{k}": maj_at_k(answers, correct, k) for k in dataset.ks})
    metrics.update({
        "reward_mean": mean([r.reward for r in records]),
        "response_length": mean([r.length for r in records]),
        "truncated_fraction": mean([float(r.finish_reason == "length") for r in records]),
        "aborted_fraction": mean([float(r.finish_reason == "abort") for r in records]),
    })
    trajectories = [r.trajectory for r in records if r.trajectory is not None]
    if trajectories:
        metrics.update(trajectory_metrics(trajectories))
    return metrics


def trajectory_metrics(trajectories: Sequence[TrajectoryRecord]) -> dict[str, float]:
    """An agentic dataset's metrics: turns_mean and tool_calls_mean (per trajectory), tool_error_rate (failed or
    invalid tool calls per tool call, 0 without calls), as the training's agent/* metrics define them."""
    calls = sum(t.tool_calls for t in trajectories)
    return {
        "turns_mean": float(mean([t.turns for t in trajectories])),
        "tool_calls_mean": calls / len(trajectories),
        "tool_error_rate": sum(t.tool_errors for t in trajectories) / max(calls, 1),
    }
