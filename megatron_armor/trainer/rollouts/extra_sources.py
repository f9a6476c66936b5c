"""What the rollout phase asks of a rollout source whose samples join each prompt's group (`StepSources.extra_samples`
names it; ARMOR's anchors, trainer/rollouts/anchors.py, are the one there is).

The phase opens each such source once per generation batch with what the batch is (`DrawnBatch`) and gets a handle
(`ExtraSamples`) that says whether its samples are taken before or after the batch's on-policy samples and gives them;
how they are sampled (now, or ahead on a thread of the source's own: `ExtraSampleSource.sample_ahead`) and seeded is the
source's. Every rank makes the same calls in the same order, so the sources' collectives match over ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist

from megatron_armor.data.datasets import PromptRow, PromptSampler
from megatron_armor.data.types import Sample
from megatron_armor.trainer.rollouts.samples import RolloutCounters
from megatron_armor.trainer.step_inputs.policies import Policy


@dataclass(frozen=True)
class DrawnBatch:
    """One generation batch as its extra sources see it: its `prompts` (`samples.draw_prompts`), drawn from
    `sampler` at `position` (the sampler's state before them: `sampler.at(position)` draws them again, and the
    batches after them), the `counters` its samples count in, the process `group` its collectives run over (None:
    the default one) and the `policy` that samples its training responses."""

    prompts: list[PromptRow]
    position: dict[str, Any]
    sampler: PromptSampler
    counters: RolloutCounters
    group: dist.ProcessGroup | None
    policy: Policy


class ExtraSamples(Protocol):
    """One generation batch's samples from an extra source (`ExtraSampleSource.open`)."""

    before_on_policy: bool  # `take` them before the batch's on-policy samples are drawn (else after)

    def take(self) -> list[Sample]:
        """The batch's samples of this source (collective over the batch's group when sampled now), its time and
        pushes counted in the batch's counters."""
        ...


class ExtraSampleSource(Protocol):
    """A rollout source whose samples join each prompt's group, named `name` by `StepSources.extra_samples`."""

    name: str

    def open(self, batch: DrawnBatch) -> ExtraSamples:
        """Its samples of generation batch `batch` (which it may start sampling on a thread of its own)."""
        ...

    def sample_ahead(self, group: dist.ProcessGroup | None, depth: int) -> None:
        """From now on it may sample ahead, on a thread whose collectives run over `group` (a process group of its
        own), up to `depth` generation batches beyond the one in use (the overlapped rollout modes)."""
        ...

    def drain_ahead(self) -> None:
        """Wait until what it samples ahead is sampled (nothing is in flight: it may be read)."""
        ...

    def drop_ahead(self) -> None:
        """Drain, then drop what it sampled ahead (it is no longer valid: a reference reset, the anchor action)."""
        ...

    def metrics(
        self, groups: list[list[Sample]], extra: Sequence[list[Sample]], counters: RolloutCounters, *,
        policy: Policy, group: dist.ProcessGroup | None,
    ) -> dict[str, float]:
        """What its samples (`extra`: trajectories, each its samples) add to a rollout's metrics, among the kept
        `groups`; `policy` sampled the training responses (collective over `group`)."""
        ...
