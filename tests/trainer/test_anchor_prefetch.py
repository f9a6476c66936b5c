"""ARMOR's anchors sampled beside and ahead of the actor's samples (trainer/rollouts/anchor_prefetch.py) over a real
`PromptSampler`, with an anchor source that records what it was asked for, on which thread."""

import threading
import time

import pytest

from megatron_armor.data.datasets import PromptRow, PromptSampler
from megatron_armor.data.types import Sample
from megatron_armor.trainer.rollouts.anchor_prefetch import AnchorPrefetch
from megatron_armor.trainer.rollouts.samples import RolloutCounters, draw_prompts

ROWS = [PromptRow(i, [1, i], {}) for i in range(12)]


class RecordingAnchors:
    """An anchor source: `sample` returns one anchor per prompt whose response encodes the seed (the position's), after
    `seconds`; the calls are recorded as (prompt ids, seed, thread name)."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.sampler, self.seconds = PromptSampler(ROWS, 3, seed=0), seconds
        self.calls: list[tuple[list[int], tuple, str]] = []
        self.fail = False

    @staticmethod
    def seed(position: dict) -> tuple:
        return (7, *position.values(), "ref")

    def sample(self, prompts, seed, counters: RolloutCounters, *, group) -> list[Sample]:
        if self.fail:
            raise ValueError("reference engine died")
        time.sleep(self.seconds)
        self.calls.append(([p.prompt_ids[1] for p in prompts], seed, threading.current_thread().name))
        counters.anchor_cache_hits += 1
        return [Sample(p.index, p.prompt_ids, [hash(seed) % 100], [0.0], "stop", True) for p in prompts]


def _positions(count: int) -> list[dict]:
    sampler, out = PromptSampler(ROWS, 3, seed=0), []
    for _ in range(count):
        out.append(sampler.state_dict())
        sampler.next_batch()
    return out


def _inline(position: dict) -> tuple[list[int], tuple]:
    """What the generation batch at `position` would sample anchors for itself: its prompts and seed."""
    prompts = draw_prompts(PromptSampler(ROWS, 3, seed=0).at(position))
    return [p.prompt_ids[1] for p in prompts], (7, position["epoch"], position["cursor"], "ref")


def test_anchors_sampled_ahead_are_the_batch_s_own_and_at_most_depth_batches_ahead():
    """Each batch's anchors are those it would sample itself (same prompts, same seed), sampled by the thread
    for the batch and the `depth` after it, no more, across an epoch boundary (4 batches an epoch); a batch's own
    submission of a job submitted ahead changes nothing."""
    source = RecordingAnchors()
    prefetch = AnchorPrefetch(source, None, 2)
    positions = _positions(6)
    for n, position in enumerate(positions):
        prefetch.submit_ahead(source.sampler, position)
        prefetch.submit(position, draw_prompts(source.sampler.at(position)))  # the batch's own
        counters = RolloutCounters()
        anchors = prefetch.take(position, counters)
        prompts, seed = _inline(position)
        assert [a.prompt_ids[1] for a in anchors] == prompts and all(a.is_anchor for a in anchors)
        assert [a.response_ids for a in anchors] == [[hash(seed) % 100]] * 3
        assert counters.anchor_cache_hits == 1  # the thread's counters join the batch's
        prefetch.drain()
        assert len(source.calls) == n + 3  # batches 0 .. n + 2: once each
        assert [(p, s) for p, s, _ in source.calls[: n + 1]] == [_inline(q) for q in positions[: n + 1]]
    assert {thread for _, _, thread in source.calls} == {"anchor-prefetch"}


def test_a_batch_s_anchors_sample_while_its_actor_does_and_reset_and_failures():
    """Anchors submitted when a batch draws its prompts are sampled while its actor samples (the anchor job waits for the actor's part to begin, and the actor's part for the anchor job to begin);
    reset drops what was sampled ahead; a failure of the thread reaches every later call."""
    source = RecordingAnchors()
    prefetch = AnchorPrefetch(source, None, 2)
    actor_began, anchors_began = threading.Event(), threading.Event()
    sample = source.sample

    def concurrent_anchors(prompts, seed, counters, *, group):
        anchors_began.set()
        assert actor_began.wait(10)
        return sample(prompts, seed, counters, group=group)

    source.sample = concurrent_anchors
    sampler = PromptSampler(ROWS, 3, seed=0)
    first, prompts = sampler.state_dict(), draw_prompts(sampler)
    second = sampler.state_dict()
    prefetch.submit(first, prompts)
    actor_began.set()  # the actor's part of the batch
    assert anchors_began.wait(10)
    assert len(prefetch.take(first, RolloutCounters())) == 3
    with pytest.raises(RuntimeError, match="sampled ahead for other prompts"):
        prefetch.submit(second, prompts)
        prefetch.submit(second, prompts[1:])
    prefetch.take(second, RolloutCounters())
    source.sample = sample
    positions = _positions(8)
    prefetch.submit_ahead(source.sampler, positions[0])
    prefetch.reset()  # e.g. a reference reset: drops batches 0-2, sampled ahead
    with pytest.raises(RuntimeError, match="were never submitted"):
        prefetch.take(positions[0], RolloutCounters())
    calls = len(source.calls)
    prefetch.submit_ahead(source.sampler, positions[4])  # the sampler was rewound elsewhere: start from there
    prefetch.drain()
    assert [(p, s) for p, s, _ in source.calls[calls:]] == [_inline(q) for q in positions[4:7]]
    prefetch.take(positions[4], RolloutCounters())
    source.fail = True
    prefetch.submit_ahead(source.sampler, positions[5])  # submits batch 7, which fails
    for call in (prefetch.drain, prefetch.reset, lambda: prefetch.take(positions[7], RolloutCounters())):
        with pytest.raises(RuntimeError, match="sampling anchors ahead failed: reference engine died"):
            call()
