"""rollout.mode async (trainer/rollouts/async_rollouts.py) over a real `PromptSampler` and a rollout phase that records
which prompts each generation batch drew and which weights the engine held from its start to its end."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from megatron_armor.algorithms import GroupCollector, GroupStats
from megatron_armor.config import ConfigError, RolloutConfig, load_config
from megatron_armor.data.datasets import PromptRow, PromptSampler
from megatron_armor.data.types import Sample
from megatron_armor.rollout.base import SamplingParams
from megatron_armor.rollout.local import LocalEngine
from megatron_armor.rollout.pausable import PausableEngine
from megatron_armor.trainer.rollouts.anchor_prefetch import AnchorPrefetch
from megatron_armor.trainer.rollouts.async_rollouts import AsyncRollouts
from megatron_armor.trainer.rollouts.rollout_phase import GenerationBatch, Rollout
from megatron_armor.trainer.rollouts.rollout_schedule import ROLLOUT_SCHEDULES
from megatron_armor.trainer.rollouts.samples import RolloutCounters, draw_prompts

from ahead_calls import RecordsAheadCalls

ROWS = [PromptRow(i, [1, i], {}) for i in range(12)]


class BatchPhase(RecordsAheadCalls):
    """`generation_batch` draws the sampler's next 3 prompts (one group each) in `seconds` and records (prompts, the
    engine's weights at the start and at the end, thread); a step takes `train_batch_size` groups."""

    def __init__(self, sampler: PromptSampler, engine: dict, *, max_staleness: int, buffer_batches: int,
                 seconds: float = 0.0, train_batch_size: int = 3) -> None:
        self.plan = SimpleNamespace(rollout=RolloutConfig(mode="async", max_staleness=max_staleness,
                                                          async_buffer_batches=buffer_batches))
        self.sampler, self.engine, self.seconds, self.train_batch_size = sampler, engine, seconds, train_batch_size
        self.calls: list[tuple[list[int], int, int, str]] = []
        self.fail_at: int | None = None  # the batch (0-based) that raises

    def new_collector(self) -> GroupCollector:
        return GroupCollector(target_prompts=self.train_batch_size, max_num_gen_batches=100)

    def generation_batch(self, key: tuple, on_actor_done=None) -> GenerationBatch:
        if len(self.calls) == self.fail_at:
            raise ValueError("engine died")
        prompts = [row.index for row in self.sampler.next_batch()]
        weights = self.engine["weights"]
        time.sleep(self.seconds)
        self.calls.append((prompts, weights, self.engine["weights"], threading.current_thread().name))
        if on_actor_done is not None:
            on_actor_done()
        return GenerationBatch([[p] for p in prompts], GroupStats(prompts_seen=3, kept=3), [], [], None)

    def assemble(self, collector: GroupCollector, batches: list, group) -> Rollout:
        return Rollout(collector.result(), {"train/num_gen_batches": float(collector.num_gen_batches)})


def _schedule(*, max_staleness: int = 1, buffer_batches: int = 2, seconds: float = 0.0, last_step: int = 100,
              sampler: PromptSampler | None = None):
    sampler = sampler or PromptSampler(ROWS, 3, seed=0)
    engine = {"weights": 0}
    phase = BatchPhase(sampler, engine, max_staleness=max_staleness, buffer_batches=buffer_batches, seconds=seconds)
    return ROLLOUT_SCHEDULES["async"](phase, sampler, last_step), phase, engine


def _train(schedule, engine, step: int, *, seconds: float = 0.0) -> None:
    """RLTrainer.step around the update: train for `seconds`, settle before the push, push version step + 1."""
    time.sleep(seconds)
    schedule.settle()
    engine["weights"] = step + 1
    schedule.weights_changed()


def test_async_never_trains_a_sample_older_than_max_staleness_when_the_generator_runs_ahead():
    """A fast generator fills a buffer of 3 batches while a slow trainer trains: batches sampled 2 versions back are
    dropped (counted), every trained group is at most max_staleness 1 version old, and each batch carries the version of
    the weights the engine held from its start to its end (a push never lands mid-batch)."""
    schedule, phase, engine = _schedule(max_staleness=1, buffer_batches=3)
    assert isinstance(schedule, AsyncRollouts)
    trained, dropped = [], 0
    for step in range(6):
        rollout = schedule.take(step)
        assert [schedule.version - v for v in rollout.versions] == [rollout.metrics["async/staleness_max"]] * 3
        assert rollout.metrics["async/staleness_max"] <= 1 and len(rollout.groups) == 3
        trained += [group[0] for group in rollout.groups]
        dropped += rollout.metrics["async/dropped_stale_groups"]
        _train(schedule, engine, step, seconds=0.05)
        assert set(schedule.step_metrics()) == {"perf/trainer_idle_seconds", "perf/rollout_idle_seconds",
                                                "perf/overlap_fraction"}
    assert dropped > 0
    assert all(start == end for _, start, end, _ in phase.calls)
    assert all(thread == "rollout-generator" for *_, thread in phase.calls)
    drawn = [p for prompts, *_ in phase.calls for p in prompts]
    assert len(trained) + dropped + 3 * len(schedule._buffer) == len(drawn)  # each drawn prompt once: trained,
    # dropped or still buffered


class AnchoredPhase(BatchPhase):
    """BatchPhase for ARMOR: a batch submits its anchors to the anchor thread (an `AnchorPrefetch` made when the
    schedule asks the phase to sample ahead) when it draws its prompts and takes them after its on-policy part; the
    reference's engine takes `anchor_seconds` a batch to sample them (the phase is the thread's anchor source: `seed`,
    `sample`)."""

    def __init__(self, sampler: PromptSampler, engine: dict, *, anchor_seconds: float) -> None:
        super().__init__(sampler, engine, max_staleness=1, buffer_batches=2, seconds=0.05)
        self.anchor_seconds = anchor_seconds
        self.prefetch: AnchorPrefetch | None = None

    def sample_ahead(self, group, depth: int) -> None:
        super().sample_ahead(group, depth)
        self.prefetch = AnchorPrefetch(self, group, depth)

    def drain_ahead(self) -> None:
        super().drain_ahead()
        self.prefetch.drain()

    def drop_ahead(self) -> None:
        super().drop_ahead()
        self.prefetch.reset()

    @staticmethod
    def seed(position: dict) -> tuple:
        return (*position.values(), "ref")

    def sample(self, prompts, seed, counters, *, group) -> list[Sample]:
        time.sleep(self.anchor_seconds)
        return [Sample(p.index, p.prompt_ids, [2], [0.0], "stop", True) for p in prompts]

    def generation_batch(self, key: tuple, on_actor_done=None) -> GenerationBatch:
        position = self.sampler.state_dict()
        prompts = draw_prompts(self.sampler)
        self.prefetch.submit_ahead(self.sampler, position)
        weights = self.engine["weights"]
        time.sleep(self.seconds)
        self.calls.append(([p.prompt_ids[1] for p in prompts], weights, self.engine["weights"], "actor"))
        on_actor_done()
        anchors = self.prefetch.take(position, RolloutCounters())
        assert [a.prompt_ids[1] for a in anchors] == self.calls[-1][0]  # the batch's own prompts
        return GenerationBatch([[p] for p in self.calls[-1][0]], GroupStats(prompts_seen=3, kept=3), [], anchors, None)


def test_a_weight_push_waits_for_the_actor_s_part_of_a_batch_not_for_its_anchors():
    """ARMOR's anchors come from the reference's engine, sampled ahead on a thread of their own: a push waits until the
    actor's engine is done with the batch in flight (0.05 s), not for the anchors still coming (1 s a batch)."""
    sampler = PromptSampler(ROWS, 3, seed=0)
    engine = {"weights": 0}
    phase = AnchoredPhase(sampler, engine, anchor_seconds=1.0)
    schedule = ROLLOUT_SCHEDULES["async"](phase, sampler, 100)
    assert phase.ahead_calls == [("sample_ahead", None, 2)]  # the buffer's batches ahead (no torch.distributed)
    schedule.take(0)  # waits for batch 0's anchors; batch 1's are being sampled meanwhile
    start = time.perf_counter()
    _train(schedule, engine, 0)
    assert time.perf_counter() - start < 0.5
    assert len(phase.calls) == 2 and phase.calls[1][1:3] == (0, 0)  # batch 1's on-policy part ran before the push
    rollout = schedule.take(1)  # batch 1, its anchors arrived after the push: sampled by version 0
    assert rollout.versions == [0, 0, 0] and schedule.version == 1
    schedule.close()


def test_a_weight_push_waits_for_the_batch_in_flight_not_the_whole_buffer():
    schedule, phase, engine = _schedule(buffer_batches=4, seconds=0.05)
    schedule.take(0)
    _train(schedule, engine, 0)  # the generator may begin 4 more batches, but stops after the one it is generating
    assert len(phase.calls) <= 2
    generated = len(phase.calls)
    time.sleep(0.15)
    assert len(phase.calls) == generated  # stopped through the push until the next take
    rollout = schedule.take(1)
    assert rollout.metrics["async/staleness_max"] <= 1


def test_a_resumed_async_run_trains_every_prompt_of_the_epoch_once():
    """A checkpoint after step 1 saves the sampler from before the oldest batch not trained (buffered or generating):
    the resumed run draws those prompts again, so over both runs each prompt of the epoch is trained exactly once."""
    schedule, phase, engine = _schedule(max_staleness=10, buffer_batches=3)
    trained = []
    for step in range(2):
        trained += [group[0] for group in schedule.take(step).groups]
        _train(schedule, engine, step, seconds=0.05)
    saved = schedule.sampler_state()
    assert phase.ahead_calls[-1] == "drain_ahead"  # what the checkpoint reads of the anchor cache stands still
    assert len(phase.calls) > 2  # batches generated ahead, lost with the process
    sampler = PromptSampler(ROWS, 3, seed=0)
    sampler.load_state_dict(saved)
    resumed, resumed_phase, engine = _schedule(max_staleness=10, buffer_batches=3, sampler=sampler, last_step=4)
    for step in range(2, 4):
        trained += [group[0] for group in resumed.take(step).groups]
        _train(resumed, engine, step)
    assert sorted(trained) == list(range(12))
    assert resumed_phase.calls[0][0] == phase.calls[2][0]  # the same prompts, regenerated


def test_discarding_the_buffer_draws_its_prompts_again_from_the_current_weights():
    schedule, phase, engine = _schedule(buffer_batches=3)
    schedule.take(0)
    _train(schedule, engine, 0, seconds=0.05)
    buffered = [prompts for prompts, *_ in phase.calls[1:]]
    schedule.discard_queued()  # e.g. a reference reset: the anchors were the old reference's
    assert phase.ahead_calls[-1] == "drop_ahead"
    rollout = schedule.take(1)
    assert [group[0] for group in rollout.groups] == buffered[0] and rollout.versions == [1, 1, 1]


def test_a_failed_generator_fails_the_trainer_thread_that_waits_for_it():
    schedule, phase, engine = _schedule(buffer_batches=2)
    phase.fail_at = 1
    with pytest.raises(RuntimeError, match="the asynchronous rollout generator failed: engine died"):
        schedule.take(0)
        _train(schedule, engine, 0)
        schedule.take(1)


class EnginePhase(BatchPhase):
    """`generation_batch` samples the sampler's next 3 prompts (one sample each, 48 tokens, no stop token) from a real
    in-process engine behind a `PausableEngine`: the engine of rollout.partial_rollouts."""

    def __init__(self, sampler: PromptSampler, engine: PausableEngine, *, max_staleness: int) -> None:
        super().__init__(sampler, {}, max_staleness=max_staleness, buffer_batches=2)
        self.plan.rollout.partial_rollouts = True
        self.models = SimpleNamespace(actor=SimpleNamespace(engine=engine))

    def generation_batch(self, key: tuple, on_actor_done=None) -> GenerationBatch:
        prompts = [row.index for row in self.sampler.next_batch()]
        sampling = SamplingParams(max_new_tokens=48, seed=len(self.calls))
        generations = self.models.actor.engine.generate([[1, p + 2] for p in prompts], sampling)
        self.calls.append((prompts, None, None, threading.current_thread().name))
        on_actor_done()
        groups = [[Sample(p, [1, p + 2], g.response_ids, g.logprobs, g.finish_reason, False, token_versions=g.versions)]
                  for p, g in zip(prompts, generations)]
        return GenerationBatch(groups, GroupStats(prompts_seen=3, kept=3), [], [], None)


def test_with_partial_rollouts_a_push_interrupts_the_batch_in_flight_which_goes_on_under_the_new_weights(
    tiny_model_factory,
):
    """settle pauses the engine mid-batch instead of waiting for the batch; after the push the batch continues with
    the new weights: its samples mix versions, a group is as old as its oldest token, and no trained sample has a
    token older than max_staleness."""
    engine = LocalEngine(tiny_model_factory("qwen2"))
    engine.model.register_forward_pre_hook(lambda module, args: time.sleep(0.01))  # >= 0.5 s a batch: the
    # generator, slower than the trainer, is always mid-batch when the trainer settles
    sampler = PromptSampler(ROWS, 3, seed=0)
    phase = EnginePhase(sampler, PausableEngine(engine), max_staleness=1)
    schedule = ROLLOUT_SCHEDULES["async"](phase, sampler, 100)
    mixed, settles = 0, []
    for step in range(4):
        rollout = schedule.take(step)
        samples = [group[0] for group in rollout.groups]
        assert rollout.versions == [min(s.token_versions) for s in samples]
        assert [schedule.version - v for v in rollout.versions] == [rollout.metrics["async/staleness_max"]] * 3
        assert rollout.metrics["async/staleness_max"] <= 1
        assert all(s.token_versions == sorted(s.token_versions) and len(s.response_ids) == 48 for s in samples)
        assert rollout.metrics["async/partial_fraction"] == sum(len(set(s.token_versions)) > 1 for s in samples) / 3
        mixed += sum(len(set(s.token_versions)) > 1 for s in samples)
        time.sleep(0.05)  # training, while the generator samples the next batch
        start = time.perf_counter()
        schedule.settle()
        settles.append(time.perf_counter() - start)
        with torch.no_grad():  # the push: new weights, version step + 1
            engine.update_weights([(name, p * 1.05) for name, p in engine.named_parameters_hf().items()])
        schedule.weights_changed()
    assert mixed > 0
    assert max(settles) < 0.25  # a pause returns within a decode step or two, not a 0.5 s batch
    schedule.close()  # the batches begun finish: no generator is left inside its batch
    assert schedule._finished == schedule._begun


def test_overlapped_modes_refuse_a_shared_anchor_engine_and_async_checks_its_bounds():
    for mode in ("one_step_off", "async"):
        with pytest.raises(ConfigError, match=f"rollout.mode {mode} generates in a background thread, but "
                                              "rollout.anchors.engine shared"):
            load_config(None, [f"rollout.mode={mode}", "rollout.anchors.engine=shared"])
    with pytest.raises(ConfigError, match="rollout.mode async overlaps generation with training, but "
                                          "rollout.memory.offload_trainer"):
        load_config(None, ["rollout.mode=async", "rollout.memory.offload_trainer=true"])
    with pytest.raises(ConfigError, match="rollout.max_staleness must be >= 0, got -1"):
        load_config(None, ["rollout.mode=async", "rollout.max_staleness=-1"])
    assert load_config(None, ["task.synthetic=arithmetic", "rollout.mode=async"]).rollout.max_staleness == 1
    with pytest.raises(ConfigError, match="rollout.partial_rollouts continues generations a weight push interrupted, "
                                          "which only rollout.mode async does"):
        load_config(None, ["rollout.mode=one_step_off", "rollout.partial_rollouts=true"])
    with pytest.raises(ConfigError, match=r"train.routing_replay rollout \(R3\) would replay a mix"):
        load_config(None, ["task.synthetic=arithmetic", "rollout.mode=async", "rollout.partial_rollouts=true",
                           "train.routing_replay=rollout"])
