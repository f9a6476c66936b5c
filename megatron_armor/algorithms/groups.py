"""Prompt filtering and group building (ARMOR section 1; DAPO dynamic sampling for GRPO)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

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


def select_group(
    on_policy: Sequence[Sample], anchors: Sequence[Sample], *, require_anchor: bool, filter_groups: bool
) -> tuple[list[Sample] | None, str]:
    """The training group of one prompt, or None, with the reason ("kept", "all_correct", ...).

    Kept iff 1 <= #correct(on-policy) <= len(on_policy) - 1 (when filter_groups) and, when
    require_anchor, some anchor is correct. The group is all on-policy samples followed by the
    first correct anchor in generation order.
    """
    correct = sum(s.correct for s in on_policy)
    if filter_groups and correct == len(on_policy):
        return None, "all_correct"
    if filter_groups and correct == 0:
        return None, "all_wrong"
    if not require_anchor:
        return list(on_policy), "kept"
    anchor = next((a for a in anchors if a.correct), None)
    if anchor is None:
        return None, "no_anchor"
    return [*on_policy, anchor], "kept"


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
        stats.anchors_used += sum(s.is_anchor for s in group)
    return kept, stats


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
