"""Anchor cache with a real engine: reuse until reset, batch prompt indices, LRU bound, JSON state.

A training run with it: tests/rollout/test_shared_anchor_engine.py.
"""

import dataclasses
import json

import pytest

from megatron_armor.config import AnchorsConfig
from megatron_armor.data.datasets import PromptRow
from megatron_armor.models.tokenizer import load_tokenizer
from megatron_armor.rewards.arithmetic import make_rows, verify
from megatron_armor.rollout.base import SamplingParams
from megatron_armor.rollout.local import LocalEngine
from megatron_armor.trainer.rollouts.anchor_cache import AnchorCache
from megatron_armor.trainer.rollouts.samples import SampleScorer, generate_samples

REF_N = 3


@pytest.fixture(scope="module")
def anchor_source(tiny_model_factory):
    """(prompts) -> (generate(missing) for AnchorCache.fetch, list of the prompt batches it was called with)."""
    model = tiny_model_factory("qwen2")
    tokenizer = load_tokenizer(model)
    engine = LocalEngine(model, pad_token_id=tokenizer.pad_token_id or 0)
    scorer = SampleScorer(tokenizer, verify)
    sampling = SamplingParams(max_new_tokens=6, seed=0)
    rows = make_rows(5, seed=0)
    prompts = [PromptRow(i, tokenizer.encode(r["prompt"], add_special_tokens=False), r) for i, r in enumerate(rows)]
    calls: list[list[PromptRow]] = []

    def generate(missing):
        calls.append(missing)
        return generate_samples(engine, missing, REF_N, sampling, scorer, is_anchor=True, seed=0)

    return prompts, generate, calls


def _batch(prompts, order):
    """The prompts at `order`, indexed by their position in this batch (as collect_groups does)."""
    return [dataclasses.replace(prompts[p], index=i) for i, p in enumerate(order)]


def test_anchors_are_sampled_once_and_reused_with_the_batch_prompt_index(anchor_source):
    prompts, generate, calls = anchor_source
    calls.clear()
    cache = AnchorCache(AnchorsConfig(cache=True, cache_max_prompts=10))
    first, hits = cache.fetch(_batch(prompts, [0, 1, 2, 1]), generate)  # prompt 1 twice: sampled once
    assert hits == 0 and [[p.prompt_ids for p in c] for c in calls] == [[prompts[p].prompt_ids for p in (0, 1, 2)]]
    assert [a.prompt_index for a in first] == [i for i in range(4) for _ in range(REF_N)]
    assert all(a.is_anchor for a in first) and first[REF_N:2 * REF_N] == [
        dataclasses.replace(a, prompt_index=1) for a in first[3 * REF_N:]
    ]

    second, hits = cache.fetch(_batch(prompts, [2, 3, 0]), generate)  # only prompt 3 is new
    assert hits == 2 and [p.prompt_ids for p in calls[-1]] == [prompts[3].prompt_ids]
    assert [a.prompt_index for a in second] == [i for i in range(3) for _ in range(REF_N)]
    assert second[:REF_N] == [dataclasses.replace(a, prompt_index=0) for a in first[2 * REF_N:3 * REF_N]]
    assert second[2 * REF_N:] == [dataclasses.replace(a, prompt_index=2) for a in first[:REF_N]]

    calls.clear()
    assert cache.fetch(_batch(prompts, [3, 1]), generate)[1] == 2 and calls == []  # all cached: no generation
    cache.clear()
    assert cache.fetch(_batch(prompts, [3]), generate)[1] == 0 and len(calls) == 1  # a reset regenerates


def test_least_recently_used_prompts_are_evicted_and_state_round_trips_through_json(anchor_source):
    prompts, generate, calls = anchor_source
    cache = AnchorCache(AnchorsConfig(cache=True, cache_max_prompts=2))
    cache.fetch(_batch(prompts, [0, 1]), generate)
    cache.fetch(_batch(prompts, [0]), generate)  # 0 is now the most recently used
    cache.fetch(_batch(prompts, [2]), generate)  # evicts 1
    assert len(cache) == 2
    restored = AnchorCache(AnchorsConfig(cache=True, cache_max_prompts=2))
    restored.load_state_dict(json.loads(json.dumps(cache.state_dict())))
    calls.clear()
    original, hits = cache.fetch(_batch(prompts, [2, 0]), generate)
    assert hits == 2 and restored.fetch(_batch(prompts, [2, 0]), generate) == (original, 2) and calls == []
    assert restored.fetch(_batch(prompts, [1]), generate)[1] == 0 and len(calls) == 1
    # A batch larger than the cache is still served whole; the cache keeps its last prompts.
    anchors, _ = AnchorCache(AnchorsConfig(cache=True, cache_max_prompts=1)).fetch(_batch(prompts, [0, 1, 4]), generate)
    assert [a.prompt_index for a in anchors] == [i for i in range(3) for _ in range(REF_N)]

