"""A dataset's scored samples as records (one per response) and the metrics of a dataset computed from them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from statistics import mean
from typing import Any

from megatron_armor.evaluation.estimators import bootstrap_stderr, maj_at_k, mean_pass_at_k
from megatron_armor.evaluation.settings import EvalDataset


@dataclass(frozen=True)
class SampleRecord:
    """One evaluated response: prompt `prompt_id` (its row's index in the dataset), sample `sample` of n."""

    prompt_id: int
    sample: int
    response: str
    answer: str | None  # what the dataset's answer_fn extracted (None: nothing, or no answer_fn)
    reward: float
    correct: bool
    length: int  # response tokens, the stop token included
    finish_reason: str  # "stop" | "length" (cut at max_new_tokens) | "abort"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def dataset_metrics(records: Sequence[SampleRecord], dataset: EvalDataset, *, seed: int) -> dict[str, float]:
    """The metrics of `dataset` from its `records` (prompt-major, `dataset.n` per prompt):

    avg@n (mean correctness of every sample) and avg@n_stderr (bootstrap over prompts, seeded by `seed`);
    pass@k and, with an answer_fn, maj@k for each k of `dataset.ks`; reward_mean; response_length (mean tokens);
    truncated_fraction (cut at max_new_tokens) and aborted_fraction (an interrupted engine's).
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
    return metrics
