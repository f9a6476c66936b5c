"""Prompt filtering and group building (ARMOR section 1; DAPO dynamic sampling for GRPO), over trajectories.

A group's unit is the trajectory: one sample, or the segments of a multi-turn rollout forked on drift (samples with
the same `Sample.trajectory`, rollout.agentic.on_drift fork). Filtering counts trajectories, ARMOR's first correct
anchor joins the group with all its segments, and the group advantages are the trajectories' (`trajectory_advantages`),
each segment carrying its trajectory's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from megatron_armor.algorithms.advantages import AdvantageBaseline, group_advantages
from megatron_armor.algorithms.reduce import masked_mean
from megatron_armor.data.types import Sample


@dataclass
class GroupStats:
    """Counts of one or more generation batches' prompts by filtering outcome."""

    prompts_seen: int = 0
    kept: int = 0
    dropped_all_correct: int = 0
    dropped_all_wrong: int = 0
    dropped_no_anchor: int = 0
    anchors_used: int = 0

    def merge(self, other: GroupStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


def trajectory_members(samples: Sequence[Sample], group_ids: Sequence[int] | None = None) -> list[list[int]]:
    """The indices into `samples` of each trajectory's samples, trajectories in order of first appearance: samples of
    one group (`group_ids[i]`; default: all one group) with the same `is_anchor` and `Sample.trajectory` are one
    trajectory's segments (in their order); a sample without `trajectory` is one alone."""
    members: dict[tuple, list[int]] = {}
    for i, sample in enumerate(samples):
        own = ("sample", i) if sample.trajectory is None else ("request", sample.trajectory)
        members.setdefault((0 if group_ids is None else group_ids[i], sample.is_anchor, own), []).append(i)
    return list(members.values())


def trajectories(samples: Sequence[Sample]) -> list[list[Sample]]:
    """One group's `samples` as trajectories, each its segments (`trajectory_members`)."""
    return [[samples[i] for i in members] for members in trajectory_members(samples)]


def trajectory_advantages(
    samples: Sequence[Sample], group_ids: Sequence[int], *, eps: float = 1e-6, baseline: AdvantageBaseline = "mean",
    quantile: float = 0.45,
) -> torch.Tensor:
    """[N] float32: each sample's advantage, `group_advantages` of the trajectories' rewards (a trajectory's first
    sample's: its segments carry the same) in the groups `group_ids` [N]: a trajectory counts once in its group's
    mean, std and quantile, and all its segments get its advantage."""
    members = trajectory_members(samples, group_ids)
    rewards = torch.tensor([samples[m[0]].reward for m in members], dtype=torch.float32)
    advantages = group_advantages(rewards, torch.tensor([group_ids[m[0]] for m in members], dtype=torch.long),
                                  eps=eps, baseline=baseline, quantile=quantile)
    return advantages[trajectory_owners(members, len(samples))]


def trajectory_owners(members: list[list[int]], n: int) -> torch.Tensor:
    """[n] long: the trajectory of each of `n` samples, its place in `members` (`trajectory_members`' list)."""
    owner = torch.empty(n, dtype=torch.long)
    for t, m in enumerate(members):
        owner[m] = t
    return owner


def select_group(
    on_policy: Sequence[Sample], anchors: Sequence[Sample], *, require_anchor: bool, filter_groups: bool
) -> tuple[list[Sample] | None, str]:
    """The training group of one prompt, or None, with the reason ("kept", "all_correct", ...).

    Counted in trajectories (`trajectories`: a forked one's segments share its `correct`): kept iff
    1 <= #correct(on-policy) <= #on-policy - 1 (when filter_groups) and, when require_anchor, some anchor is correct.
    The group is all on-policy samples followed by the first correct anchor trajectory in generation order (all its
    segments).
    """
    rolled_out = trajectories(on_policy)
    correct = sum(t[0].correct for t in rolled_out)
    if filter_groups and correct == len(rolled_out):
        return None, "all_correct"
    if filter_groups and correct == 0:
        return None, "all_wrong"
    if not require_anchor:
        return list(on_policy), "kept"
    anchor = next((a for a in trajectories(anchors) if a[0].correct), None)
    if anchor is None:
        return None, "no_anchor"
    return [*on_policy, *anchor], "kept"


def build_groups(
    samples: Sequence[Sample], *, require_anchor: bool, filter_groups: bool
) -> tuple[list[list[Sample]], GroupStats]:
    """Group one generation batch's samples by prompt_index (order of first appearance kept)."""
    by_prompt: dict[int, tuple[list[Sample], list[Sample]]] = {}
    for sample in samples:
        on_policy, anchors = by_prompt.setdefault(sample.prompt_index, ([], []))
        (anchors if sample.is_anchor else on_policy).append(sample)
    stats = GroupStats(prompts_seen=len(by_prompt))
    kept = []
    for on_policy, anchors in by_prompt.values():
        group, reason = select_group(on_policy, anchors, require_anchor=require_anchor, filter_groups=filter_groups)
        if group is None:
            setattr(stats, f"dropped_{reason}", getattr(stats, f"dropped_{reason}") + 1)
            continue
        kept.append(group)
        stats.kept += 1
        stats.anchors_used += anchor_trajectories(group)
    return kept, stats


def anchor_trajectories(group: Sequence[Sample]) -> int:
    """The anchor trajectories in `group` (ARMOR's: one in a kept group; whatever its segments)."""
    return len(trajectories([s for s in group if s.is_anchor]))


@dataclass
class GroupCollector:
    """Accumulates kept groups over generation batches until `target_prompts` are available."""

    target_prompts: int
    max_num_gen_batches: int
    allow_partial: bool = False
    groups: list[list[Sample]] = field(default_factory=list)
    stats: GroupStats = field(default_factory=GroupStats)
    num_gen_batches: int = 0

    @property
    def done(self) -> bool:
        return len(self.groups) >= self.target_prompts or self.num_gen_batches >= self.max_num_gen_batches

    def add(self, groups: list[list[Sample]], stats: GroupStats) -> None:
        self.groups.extend(groups)
        self.stats.merge(stats)
        self.num_gen_batches += 1

    def result(self) -> list[list[Sample]]:
        """Exactly `target_prompts` groups (fewer only with allow_partial)."""
        if len(self.groups) < self.target_prompts and not self.allow_partial:
            s = self.stats
            raise RuntimeError(
                f"only {len(self.groups)} of {self.target_prompts} prompts survived filtering after "
                f"{self.num_gen_batches} generation batches ({s.prompts_seen} prompts: {s.dropped_all_correct} all "
                f"correct, {s.dropped_all_wrong} all wrong, {s.dropped_no_anchor} without a correct anchor); raise "
                f"algorithm.max_num_gen_batches or train.gen_batch_size, or set algorithm.allow_partial_batch=true"
            )
        return self.groups[: self.target_prompts]


def mix_kl_metrics(
    old_logp: torch.Tensor, ref_logp: torch.Tensor, is_anchor: torch.Tensor, mask: torch.Tensor, *,
    with_anchors: bool = True,
) -> dict[str, float]:
    """ARMOR's k1 KL metrics: mix_kl/kl_on_old = mean(old - ref) over on-policy tokens,
    mix_kl/kl_on_ref = mean(ref - old) over anchor tokens (0 without any). [B, T] tensors, is_anchor [B] bool.

    kl_on_ref is reported iff `with_anchors` (the algorithm samples anchors), never by the content of
    the batch, so every data-parallel shard returns the same keys.
    """
    mask = mask.to(old_logp.dtype)
    anchor_mask = mask * is_anchor[:, None].to(mask.dtype)
    metrics = {"mix_kl/kl_on_old": float(masked_mean(old_logp - ref_logp, mask - anchor_mask))}
    if with_anchors:
        metrics["mix_kl/kl_on_ref"] = float(masked_mean(ref_logp - old_logp, anchor_mask))
    return metrics
