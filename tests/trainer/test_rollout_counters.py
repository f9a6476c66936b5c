"""RolloutCounters (trainer/rollouts/samples.py): a step's counters are the sums of its generation batches'."""

from megatron_armor.rewards.audit import AuditCounts
from megatron_armor.trainer.rollouts.samples import RolloutCounters


def test_merged_counters_sum_every_field_and_the_audit_counts():
    first = RolloutCounters(anchor_seconds=1.5, weight_swaps=1, anchor_cache_hits=2,
                            audit=AuditCounts(("strict",), samples=4, correct=[3], hacked=[1]))
    second = RolloutCounters(anchor_seconds=0.5, ref_push_seconds=0.25, anchor_cache_hits=1,
                             audit=AuditCounts(("strict",), samples=2, correct=[1], hacked=[0]))
    total = RolloutCounters.merged([first, second])
    assert (total.anchor_seconds, total.ref_push_seconds, total.weight_swaps, total.anchor_cache_hits) == (2.0, 0.25, 1, 3)
    assert total.audit == AuditCounts(("strict",), samples=6, correct=[4], hacked=[1])
    assert RolloutCounters.merged([RolloutCounters()]).audit is None
