"""Audit verifiers: reward functions run on the training rollouts beside the training reward, never trained on.

An audit calls a sample correct or wrong like the training verifier does; where the training verifier says
correct and an audit says wrong, the sample is a suspected hack (a response that satisfies the training
verifier's loophole without solving the task). `AuditCounts` counts both over a step's on-policy samples and
turns them into the `audit/*` metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megatron_armor.rewards.registry import RewardFn, score


def audit_name(path: str) -> str:
    """The metric name of the audit at `path`: `<module or file stem>_<function>`, e.g.
    `megatron_armor.rewards.math_dapo:verify` -> `math_dapo_verify`, `checks/strict.py:exact` -> `strict_exact`."""
    module, _, function = path.rpartition(":")
    stem = Path(module).stem if module.endswith(".py") else module.rsplit(".", 1)[-1]
    return f"{stem}_{function}"


@dataclass(frozen=True)
class AuditVerifiers:
    """The run's audit verifiers, in `reward.audit_fns` order; `names` key their metrics."""

    names: tuple[str, ...] = ()
    fns: tuple[RewardFn, ...] = ()

    def verdicts(self, response: str, row: dict) -> tuple[bool, ...]:
        """Each audit's `correct` for `response` to the prompt `row`."""
        return tuple(score(fn, response, row)[1] for fn in self.fns)

    def new_counts(self) -> AuditCounts:
        """Empty counts for these audits."""
        return AuditCounts(self.names)


@dataclass
class AuditCounts:
    """Counts over on-policy samples: `samples` seen, and per audit (in `names` order) how many it calls
    `correct` and how many are `hacked` (the training verifier says correct, the audit says wrong)."""

    names: tuple[str, ...]
    samples: int = 0
    correct: list[int] = field(default_factory=list)
    hacked: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.correct = self.correct or [0] * len(self.names)
        self.hacked = self.hacked or [0] * len(self.names)

    def add(self, train_correct: bool, verdicts: Sequence[bool]) -> None:
        """Count one sample: the training verifier's flag and each audit's."""
        self.samples += 1
        for i, audit_correct in enumerate(verdicts):
            self.correct[i] += int(audit_correct)
            self.hacked[i] += int(train_correct and not audit_correct)

    def as_vector(self) -> list[int]:
        """[samples, correct..., hacked...]: what ranks sum (`from_vector`)."""
        return [self.samples, *self.correct, *self.hacked]

    def from_vector(self, vector: Sequence[int]) -> AuditCounts:
        """Counts for the same audits from an `as_vector` layout (e.g. summed over ranks)."""
        n = len(self.names)
        return AuditCounts(self.names, int(vector[0]), [int(v) for v in vector[1 : 1 + n]],
                           [int(v) for v in vector[1 + n : 1 + 2 * n]])

    def metrics(self) -> dict[str, float]:
        """`audit/<name>_accuracy` (fraction of samples the audit calls correct), `audit/<name>_hack_rate`
        (fraction the training verifier calls correct and the audit wrong) and `audit/hack_rate`, the largest of
        the audits' hack rates (one audit that catches the loophole is enough); {} without audits."""
        if not self.names:
            return {}
        total = max(self.samples, 1)
        metrics: dict[str, float] = {}
        for name, correct, hacked in zip(self.names, self.correct, self.hacked):
            metrics[f"audit/{name}_accuracy"] = correct / total
            metrics[f"audit/{name}_hack_rate"] = hacked / total
        metrics["audit/hack_rate"] = max(hacked / total for hacked in self.hacked)
        return metrics
