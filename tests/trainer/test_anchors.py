"""ARMOR's anchor source (trainer/rollouts/anchors.py) deciding a generation batch's anchors, with real in-process
engines: taken before or after the on-policy samples by what the sampler's engine holds, sampled when taken or ahead
on a thread of their own, and in every case the samples `generate_samples` draws with the seed of the batch's sampler
position (train.seed, "anchors", epoch, cursor, "ref")."""

import threading

import pytest

from megatron_armor.algorithms import ACTOR, REFERENCE
from megatron_armor.data.datasets import PromptRow, PromptSampler
from megatron_armor.models.tokenizer import load_tokenizer
from megatron_armor.rewards.arithmetic import make_rows, verify
from megatron_armor.rollout.base import SamplingParams
from megatron_armor.rollout.local import LocalEngine
from megatron_armor.trainer.colocation.colocation import Colocation
from megatron_armor.trainer.colocation.engine_weights import EngineWeights
from megatron_armor.trainer.rollouts.anchors import AnchorSource
from megatron_armor.trainer.rollouts.extra_sources import DrawnBatch
from megatron_armor.trainer.rollouts.samples import RolloutCounters, SampleScorer, draw_prompts, generate_samples
from megatron_armor.trainer.step_inputs.policies import Policy, PolicyHandles

REF_N, TRAIN_SEED = 2, 7
SAMPLING = SamplingParams(max_new_tokens=4)


@pytest.fixture(scope="module")
def parts(tiny_model_factory):
    """(two engines of one tiny model, the scorer, 6 arithmetic prompts)."""
    model = tiny_model_factory("qwen2")
    tokenizer = load_tokenizer(model)
    pad = tokenizer.pad_token_id or 0
    engines = LocalEngine(model, pad_token_id=pad), LocalEngine(model, pad_token_id=pad)
    rows = make_rows(6, seed=0)
    prompts = [PromptRow(i, tokenizer.encode(r["prompt"], add_special_tokens=False), r) for i, r in enumerate(rows)]
    return engines, SampleScorer(tokenizer, verify), prompts


def _source(models: PolicyHandles, scorer: SampleScorer) -> AnchorSource:
    return AnchorSource(models.ref, REF_N, engine_weights=EngineWeights(models, Colocation()), sampling=SAMPLING,
                        scorer=scorer, train_seed=TRAIN_SEED)


def _next_batch(sampler: PromptSampler, policy: Policy) -> DrawnBatch:
    """The sampler's next generation batch, drawn as the rollout phase draws it."""
    position = sampler.state_dict()
    return DrawnBatch(draw_prompts(sampler), position, sampler, RolloutCounters(), None, policy)


def _expected(engine: LocalEngine, batch: DrawnBatch, scorer: SampleScorer):
    """The batch's anchors sampled directly, with the seed of its position."""
    seed = (TRAIN_SEED, "anchors", batch.position["epoch"], batch.position["cursor"], "ref")
    return generate_samples(engine, batch.prompts, REF_N, SAMPLING, scorer, is_anchor=True, seed=seed)


def _record_threads(monkeypatch, engine: LocalEngine) -> list[str]:
    """The names of the threads `engine.generate` runs on, from now on."""
    threads, generate = [], engine.generate

    def recorded(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return generate(*args, **kwargs)

    monkeypatch.setattr(engine, "generate", recorded)
    return threads


def test_anchors_of_an_engine_of_their_own_follow_the_on_policy_samples_and_are_sampled_ahead_when_asked(
    parts, monkeypatch,
):
    """The actor's engine holds its weights: the anchors come after the on-policy samples, sampled when taken; once an
    overlapped schedule asks for sampling ahead, on the thread, the batch's and the `depth` after it."""
    (actor_engine, ref_engine), scorer, prompts = parts
    models = PolicyHandles(actor=Policy(ACTOR, None, actor_engine), ref=Policy(REFERENCE, None, ref_engine),
                           optimizer=None, shape=None, pad_token_id=0)
    source, sampler = _source(models, scorer), PromptSampler(prompts, 2, seed=0)
    threads = _record_threads(monkeypatch, ref_engine)

    batch = _next_batch(sampler, models.actor)
    anchors = source.open(batch)  # sync: sampled when taken, on the caller's thread
    assert not anchors.before_on_policy and anchors.prefetch is None
    assert anchors.take() == _expected(ref_engine, batch, scorer)
    assert threads == [threading.current_thread().name] * 2  # the take, then the direct reference

    source.sample_ahead(None, 1)  # an overlapped schedule asks: each batch's anchors and the next one's on the thread
    threads.clear()
    first = _next_batch(sampler, models.actor)
    anchors = source.open(first)
    assert not anchors.before_on_policy and anchors.prefetch is not None
    taken = anchors.take()
    source.drain_ahead()
    assert threads == ["anchor-prefetch"] * 2  # this batch's and the next one's, none on the caller's thread
    second = _next_batch(sampler, models.actor)
    following = source.open(second).take()  # sampled ahead already: nothing more to generate
    source.drain_ahead()
    assert threads == ["anchor-prefetch"] * 3  # ... but the batch after it, submitted now
    assert taken == _expected(ref_engine, first, scorer) and following == _expected(ref_engine, second, scorer)
    source.drop_ahead()


def test_anchors_of_an_engine_shared_with_the_actor_are_sampled_first_while_it_holds_the_reference_s_weights(
    parts, monkeypatch,
):
    """The shared engine holds the reference's weights (an anchor phase pushed them): the batch's anchors come first,
    with no push, sampled when taken even though the schedule asked for sampling ahead (no thread is made); once it
    holds the actor's weights again they come after the on-policy samples."""
    (engine, _), scorer, prompts = parts
    models = PolicyHandles(actor=Policy(ACTOR, None, engine), ref=Policy(REFERENCE, None, engine),
                           optimizer=None, shape=None, pad_token_id=0)
    models.actor.holds_weights, models.ref.holds_weights = False, True  # what `EngineWeights.push(ref)` leaves
    source, sampler = _source(models, scorer), PromptSampler(prompts, 2, seed=0)
    source.sample_ahead(None, 1)
    threads = _record_threads(monkeypatch, engine)
    batch = _next_batch(sampler, models.actor)
    anchors = source.open(batch)
    assert anchors.before_on_policy and anchors.prefetch is None
    assert anchors.take() == _expected(engine, batch, scorer)
    assert threads == [threading.current_thread().name] * 2 and batch.counters.weight_swaps == 0
    models.actor.holds_weights, models.ref.holds_weights = True, False  # the actor's weights pushed back
    assert not source.open(_next_batch(sampler, models.actor)).before_on_policy
    assert source._prefetch is None
