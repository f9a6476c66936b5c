"""ARMOR prompt filtering, anchor selection and cross-batch collection; over trajectories forked into segments."""

import statistics

import pytest
import torch

from megatron_armor.algorithms import GroupCollector, build_groups, mix_kl_metrics, trajectory_advantages
from megatron_armor.data.types import Sample


def s(prompt, correct, anchor=False, tag=0):
    return Sample(prompt, [1], [tag], [0.0], "stop", anchor, 1.0 if correct else -1.0, correct)


def batch(prompt, n_correct, anchors, n=15):
    on = [s(prompt, i < n_correct) for i in range(n)]
    return on + [s(prompt, c, anchor=True, tag=k + 1) for k, c in enumerate(anchors)]


def test_filtering_rules_and_first_correct_anchor():
    samples = (
        batch(0, 5, [False, True, True, False])  # kept, anchor tag 2
        + batch(1, 15, [True] * 4)  # all correct -> dropped despite anchors
        + batch(2, 0, [True] * 4)  # all wrong -> dropped
        + batch(3, 7, [False] * 4)  # no correct anchor -> dropped
        + batch(4, 14, [True, False, False, False])  # kept, anchor tag 1
    )
    groups, stats = build_groups(samples, require_anchor=True, filter_groups=True)
    assert [g[0].prompt_index for g in groups] == [0, 4]
    assert all(len(g) == 16 and sum(x.is_anchor for x in g) == 1 and g[-1].is_anchor for g in groups)
    assert [g[-1].response_ids for g in groups] == [[2], [1]]
    assert (stats.kept, stats.dropped_all_correct, stats.dropped_all_wrong, stats.dropped_no_anchor) == (2, 1, 1, 1)
    assert stats.anchors_used == 2


def test_grpo_keeps_mixed_groups_without_anchors():
    groups, stats = build_groups(batch(0, 3, []) + batch(1, 0, []), require_anchor=False, filter_groups=True)
    assert len(groups) == 1 and len(groups[0]) == 15
    groups, _ = build_groups(batch(0, 3, []) + batch(1, 0, []), require_anchor=False, filter_groups=False)
    assert len(groups) == 2


def forked(prompt, rewards, anchor=False):
    """One prompt's trajectories of `rewards` (>0: correct), trajectory k forked into k + 1 segments."""
    return [Sample(prompt, [1] * (j + 1), [k], [0.0], "stop", anchor, reward, reward > 0, trajectory=k)
            for k, reward in enumerate(rewards) for j in range(k + 1)]


def test_forked_trajectories_count_once_in_filtering_anchors_and_advantages():
    """A trajectory forked into segments (the same `trajectory`) is one trajectory: filtering counts it once (prompt
    0: one correct trajectory of three, in 1 + 2 + 3 samples, is mixed), the first correct anchor joins with all its
    segments, and each segment gets its trajectory's advantage, the group normalised over trajectories (computed
    here with statistics' mean and sample std); a sample without `trajectory` is a trajectory alone."""
    samples = (forked(0, [-1.0, -1.0, 1.0]) + forked(0, [-1.0, 0.5], anchor=True)
               + forked(1, [1.0, 1.0]) + forked(1, [1.0], anchor=True))  # prompt 1: all correct, dropped
    groups, stats = build_groups(samples, require_anchor=True, filter_groups=True)
    [group] = groups
    assert [(x.trajectory, x.is_anchor) for x in group] == [(0, False), (1, False), (1, False), (2, False),
                                                            (2, False), (2, False), (1, True), (1, True)]
    assert (stats.kept, stats.dropped_all_correct, stats.anchors_used) == (1, 1, 1)

    rewards = [-1.0, -1.0, 1.0, 0.5]  # the trajectories: three on-policy, the anchor
    mean, std = statistics.mean(rewards), statistics.stdev(rewards)
    want = [(rewards[t] - mean) / (std + 1e-6) for t in (0, 1, 1, 2, 2, 2, 3, 3)]
    assert trajectory_advantages(group, [7] * len(group)).tolist() == pytest.approx(want, abs=1e-6)
    # the same samples without trajectory numbers: eight trajectories of their own, weighted by segment count
    alone = [Sample(x.prompt_index, x.prompt_ids, x.response_ids, x.engine_logprobs, "stop", x.is_anchor, x.reward,
                    x.correct) for x in group]
    every = [x.reward for x in group]
    mean, std = statistics.mean(every), statistics.stdev(every)
    assert trajectory_advantages(alone, [7] * len(alone)).tolist() == pytest.approx(
        [(r - mean) / (std + 1e-6) for r in every], abs=1e-6)


def test_collector_accumulates_truncates_and_errors():
    collector = GroupCollector(target_prompts=3, max_num_gen_batches=3)
    for prompt in range(2):
        groups, stats = build_groups(batch(prompt, 4, [True]) + batch(9, 0, [True]), require_anchor=True, filter_groups=True)
        collector.add(groups, stats)
    assert not collector.done
    groups, stats = build_groups(batch(5, 4, [True]) + batch(6, 4, [True]), require_anchor=True, filter_groups=True)
    collector.add(groups, stats)
    assert collector.done and [g[0].prompt_index for g in collector.result()] == [0, 1, 5]

    failing = GroupCollector(target_prompts=2, max_num_gen_batches=2)
    for _ in range(2):
        failing.add(*build_groups(batch(0, 0, [True]), require_anchor=True, filter_groups=True))
    assert failing.done
    with pytest.raises(RuntimeError, match="0 of 2 prompts.*max_num_gen_batches"):
        failing.result()
    partial = GroupCollector(target_prompts=2, max_num_gen_batches=1, allow_partial=True)
    partial.add(*build_groups(batch(0, 3, [True]), require_anchor=True, filter_groups=True))
    assert len(partial.result()) == 1


def test_mix_kl_metrics():
    old = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0], [-3.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    m = mix_kl_metrics(old, ref, torch.tensor([False, True]), mask)
    assert m["mix_kl/kl_on_old"] == pytest.approx(((-1 + 1.5) + (-2 + 1)) / 2)
    assert m["mix_kl/kl_on_ref"] == pytest.approx(-3.0 + 1.0)


def test_mix_kl_keys_follow_the_plan_not_the_shard():
    """A data-parallel shard without anchors still reports kl_on_ref (0) under ARMOR, so every rank
    reduces the same keys; algorithms without anchors never report it."""
    old, ref, mask = torch.zeros(2, 2), torch.full((2, 2), -1.0), torch.ones(2, 2)
    no_anchor = torch.tensor([False, False])
    assert mix_kl_metrics(old, ref, no_anchor, mask) == {"mix_kl/kl_on_old": 1.0, "mix_kl/kl_on_ref": 0.0}
    assert mix_kl_metrics(old, ref, no_anchor, mask, with_anchors=False) == {"mix_kl/kl_on_old": 1.0}
