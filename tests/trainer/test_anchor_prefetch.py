"""ARMOR's anchors sampled ahead (trainer/anchor_prefetch.py) over a real `PromptSampler`, with a rollout phase whose
`sample_anchors` records what it was asked for, on which thread."""

import threading
import time

import pytest

from megatron_armor.data.datasets import PromptRow, PromptSampler
from megatron_armor.data.types import Sample
from megatron_armor.trainer.anchor_prefetch import AnchorPrefetch
from megatron_armor.trainer.async_rollouts import batch_key
from megatron_armor.trainer.rollout_phase import RolloutPhase
from megatron_armor.trainer.samples import RolloutCounters

ROWS = [PromptRow(i, [1, i], {}) for i in range(12)]


class AnchorPhase:
    """`sample_anchors` returns one anchor per prompt whose response encodes the seed, after `seconds`; the calls are
    recorded as (prompt indices, seed, thread name)."""

    def __init__(self, sampler: PromptSampler, seconds: float = 0.0) -> None:
        self.sampler, self.seconds = sampler, seconds
        self.calls: list[tuple[list[int], tuple, str]] = []
        self.fail = False

    draw_prompts = staticmethod(RolloutPhase.draw_prompts)

    def on_group(self, group):
        return self

    def seed(self, key: tuple, policy: str) -> tuple:
        return (7, *key, policy)

    def sample_anchors(self, prompts, seed, counters: RolloutCounters) -> list[Sample]:
        if self.fail:
            raise ValueError("reference engine died")
        time.sleep(self.seconds)
        self.calls.append(([p.prompt_ids[1] for p in prompts], seed, threading.current_thread().name))
        counters.anchor_cache_hits += 1
        return [Sample(p.index, p.prompt_ids, [hash(seed) % 100], [0.0], "stop", True) for p in prompts]


def _inline(position: dict) -> tuple[list[int], tuple]:
    """What the generation batch at `position` would sample anchors for itself: its prompts and seed."""
    prompts = RolloutPhase.draw_prompts(PromptSampler(ROWS, 3, seed=0).at(position))
    return [p.prompt_ids[1] for p in prompts], (7, *batch_key(position), "ref")


def _positions(count: int) -> list[dict]:
    sampler, out = PromptSampler(ROWS, 3, seed=0), []
    for _ in range(count):
        out.append(sampler.state_dict())
        sampler.next_batch()
    return out


def test_anchors_are_sampled_ahead_on_their_own_thread_with_the_batch_s_own_prompts_and_seeds():
    """Each batch's anchors are those it would sample itself (same prompts, same seed), sampled by the prefetch
    thread at most `depth` batches beyond the last taken, across an epoch boundary (4 batches an epoch)."""
    phase = AnchorPhase(PromptSampler(ROWS, 3, seed=0))
    prefetch = AnchorPrefetch(phase, 2, None, batch_key)
    positions = _positions(6)
    for n, position in enumerate(positions):
        counters = RolloutCounters()
        anchors = prefetch.source(position)(counters)
        prompts, seed = _inline(position)
        assert [a.prompt_ids[1] for a in anchors] == prompts and all(a.is_anchor for a in anchors)
        assert [a.response_ids for a in anchors] == [[hash(seed) % 100]] * 3
        assert counters.anchor_cache_hits == 1  # the thread's counters join the batch's
        prefetch.drain()  # the thread samples what is issued: the `depth` batches after this one, no more
        assert len(phase.calls) == n + 1 + 2
        assert [(p, s) for p, s, _ in phase.calls[: n + 1]] == [_inline(q) for q in positions[: n + 1]]
    assert {thread for _, _, thread in phase.calls} == {"anchor-prefetch"}


def test_a_take_waits_only_for_its_own_batch_and_reset_starts_again_from_the_next_position():
    phase = AnchorPhase(PromptSampler(ROWS, 3, seed=0), seconds=0.05)
    prefetch = AnchorPrefetch(phase, 2, None, batch_key)
    positions = _positions(8)
    prefetch.take(positions[0], RolloutCounters())
    deadline = time.monotonic() + 10
    while len(phase.calls) < 3 and time.monotonic() < deadline:  # batches 1 and 2 are sampled while the generator
        time.sleep(0.01)  # is busy with batch 0's on-policy samples
    start = time.perf_counter()
    counters = RolloutCounters()
    prefetch.take(positions[1], counters)
    assert time.perf_counter() - start < 0.04 and counters.anchor_seconds < 0.04  # ready: no wait
    prefetch.reset()  # e.g. a reference reset: drops what was sampled ahead (batch 2)
    calls = len(phase.calls)
    prefetch.take(positions[4], RolloutCounters())  # the sampler was rewound elsewhere: start from its position
    assert phase.calls[calls][:2] == _inline(positions[4])
    prefetch.drain()  # batches 5 and 6 sampled ahead
    phase.fail = True
    prefetch.take(positions[5], RolloutCounters())  # sampled before the failure; issues batch 7, which fails
    with pytest.raises(RuntimeError, match="sampling anchors ahead failed: reference engine died"):
        prefetch.take(positions[6], RolloutCounters())
        prefetch.take(positions[7], RolloutCounters())
