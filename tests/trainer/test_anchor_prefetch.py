"""ARMOR's anchors sampled beside and ahead of the actor's samples (trainer/rollouts/anchor_prefetch.py) over a real
`PromptSampler`, with a rollout phase whose anchor source records what it was asked for, on which thread."""

import threading
import time

import pytest

from megatron_armor.data.datasets import PromptRow, PromptSampler
from megatron_armor.data.types import Sample
from megatron_armor.trainer.rollouts.anchor_prefetch import AnchorPrefetch, anchor_key
from megatron_armor.trainer.rollouts.rollout_phase import RolloutPhase
from megatron_armor.trainer.rollouts.samples import RolloutCounters

ROWS = [PromptRow(i, [1, i], {}) for i in range(12)]


class AnchorPhase:
    """A rollout phase that is its own anchor source: `sample` returns one anchor per prompt whose response encodes
    the seed, after `seconds`; the calls are recorded as (prompt ids, seed, thread name)."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.sampler, self.seconds = PromptSampler(ROWS, 3, seed=0), seconds
        self.calls: list[tuple[list[int], tuple, str]] = []
        self.fail = False
        self.anchors = self

    draw_prompts = staticmethod(RolloutPhase.draw_prompts)

    def seed(self, key: tuple, policy: str) -> tuple:
        return (7, *key, policy)

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
    prompts = RolloutPhase.draw_prompts(PromptSampler(ROWS, 3, seed=0).at(position))
    return [p.prompt_ids[1] for p in prompts], (7, *anchor_key(position), "ref")


def test_anchors_sampled_ahead_are_the_batch_s_own_and_at_most_depth_batches_ahead():
    """Each batch's anchors are those it would sample itself (same prompts, same seed), sampled by the thread
    for the batch and the `depth` after it, no more, across an epoch boundary (4 batches an epoch); a batch's own
    submission of a job submitted ahead changes nothing."""
    phase, prefetch = AnchorPhase(), AnchorPrefetch(None, 2)
    positions = _positions(6)
    for n, position in enumerate(positions):
        prefetch.submit_ahead(phase, position)
        key = anchor_key(position)
        prefetch.submit(key, RolloutPhase.draw_prompts(phase.sampler.at(position)), phase)  # the batch's own
        counters = RolloutCounters()
        anchors = prefetch.take(key, counters)
        prompts, seed = _inline(position)
        assert [a.prompt_ids[1] for a in anchors] == prompts and all(a.is_anchor for a in anchors)
        assert [a.response_ids for a in anchors] == [[hash(seed) % 100]] * 3
        assert counters.anchor_cache_hits == 1  # the thread's counters join the batch's
        prefetch.drain()
        assert len(phase.calls) == n + 3  # batches 0 .. n + 2: once each
        assert [(p, s) for p, s, _ in phase.calls[: n + 1]] == [_inline(q) for q in positions[: n + 1]]
    assert {thread for _, _, thread in phase.calls} == {"anchor-prefetch"}


def test_a_batch_s_anchors_sample_while_its_actor_does_and_reset_and_failures():
    """Anchors submitted when a batch draws its prompts are sampled while its actor samples (the anchor job waits for the actor's part to begin, and the actor's part for the anchor job to begin);
    reset drops what was sampled ahead; a failure of the thread reaches every later call."""
    phase, prefetch = AnchorPhase(), AnchorPrefetch(None, 2)
    actor_began, anchors_began = threading.Event(), threading.Event()
    sample = phase.sample

    def concurrent_anchors(prompts, seed, counters, *, group):
        anchors_began.set()
        assert actor_began.wait(10)
        return sample(prompts, seed, counters, group=group)

    phase.sample = concurrent_anchors
    key, prompts = ("step", 1, 0), RolloutPhase.draw_prompts(PromptSampler(ROWS, 3, seed=0))
    prefetch.submit(key, prompts, phase)
    actor_began.set()  # the actor's part of the batch
    assert anchors_began.wait(10)
    assert len(prefetch.take(key, RolloutCounters())) == 3
    with pytest.raises(RuntimeError, match="sampled ahead for other prompts"):
        prefetch.submit(("step", 2, 0), prompts, phase)
        prefetch.submit(("step", 2, 0), prompts[1:], phase)
    prefetch.take(("step", 2, 0), RolloutCounters())
    phase.sample = sample
    positions = _positions(8)
    prefetch.submit_ahead(phase, positions[0])
    prefetch.reset()  # e.g. a reference reset: drops batches 0-2, sampled ahead
    with pytest.raises(RuntimeError, match="were never submitted"):
        prefetch.take(anchor_key(positions[0]), RolloutCounters())
    calls = len(phase.calls)
    prefetch.submit_ahead(phase, positions[4])  # the sampler was rewound elsewhere: start from there
    prefetch.drain()
    assert [(p, s) for p, s, _ in phase.calls[calls:]] == [_inline(q) for q in positions[4:7]]
    prefetch.take(anchor_key(positions[4]), RolloutCounters())
    phase.fail = True
    prefetch.submit_ahead(phase, positions[5])  # submits batch 7, which fails
    for call in (prefetch.drain, prefetch.reset, lambda: prefetch.take(anchor_key(positions[7]), RolloutCounters())):
        with pytest.raises(RuntimeError, match="sampling anchors ahead failed: reference engine died"):
            call()
