"""Rollout schedules (trainer/rollouts/rollout_schedule.py) over a real `PromptSampler` and a rollout phase that records
which prompts each step drew and which weights the engine held while it generated."""

import threading

import pytest

from megatron_armor.data.datasets import PromptRow, PromptSampler
from megatron_armor.trainer.rollouts.rollout_phase import Rollout
from megatron_armor.trainer.rollouts.rollout_schedule import ROLLOUT_SCHEDULES, OneStepOffRollouts, SyncRollouts

from ahead_calls import RecordsAheadCalls

ROWS = [PromptRow(i, [1, i], {}) for i in range(12)]


class RecordingPhase(RecordsAheadCalls):
    """`collect(step)` draws one generation batch and records (step, prompt indices, engine weights, thread)."""

    def __init__(self, sampler: PromptSampler, engine: dict) -> None:
        self.sampler, self.engine, self.calls = sampler, engine, []
        self.fail_at: int | None = None

    def collect(self, step: int) -> Rollout:
        if step == self.fail_at:
            raise ValueError("engine died")
        prompts = [row.index for row in self.sampler.next_batch()]
        self.calls.append((step, prompts, self.engine["weights"], threading.current_thread().name))
        return Rollout(groups=[[prompt] for prompt in prompts], metrics={"train/reward_mean": float(step)})


def _schedule(mode: str, last_step: int = 100, sampler: PromptSampler | None = None):
    sampler = sampler or PromptSampler(ROWS, 3, seed=0)
    engine = {"weights": 0}
    phase = RecordingPhase(sampler, engine)
    return ROLLOUT_SCHEDULES[mode](phase, sampler, last_step), phase, engine


def _train(schedule, engine, step: int, *, kept: bool = True) -> None:
    """What RLTrainer.step does around the update: settle before the push, then the new weights (version step + 1)
    if the update is kept; a rolled back one leaves the engine with the weights it had."""
    schedule.settle()
    if kept:
        engine["weights"] = step + 1
        schedule.weights_changed()


def test_sync_generates_each_step_from_the_weights_it_starts_with():
    schedule, phase, engine = _schedule("sync")
    assert isinstance(schedule, SyncRollouts)
    for step in range(3):
        rollout = schedule.take(step)
        assert rollout.version == step and not any(key.startswith("async/") for key in rollout.metrics)
        _train(schedule, engine, step)
    assert [(step, weights) for step, _, weights, _ in phase.calls] == [(0, 0), (1, 1), (2, 2)]
    assert schedule.step_metrics() == {}


def test_one_step_off_samples_step_t_plus_1_from_the_weights_before_step_t_s_update():
    schedule, phase, engine = _schedule("one_step_off", last_step=4)
    assert isinstance(schedule, OneStepOffRollouts)
    assert phase.ahead_calls == [("sample_ahead", None, 1)]  # the next rollout's first batch (no torch.distributed)
    taken = []
    for step in range(4):
        rollout = schedule.take(step)
        taken.append((rollout.version, rollout.metrics["async/staleness_mean"], rollout.metrics["train/reward_mean"]))
        _train(schedule, engine, step)
        perf = schedule.step_metrics()
        assert set(perf) == {"perf/trainer_idle_seconds", "perf/rollout_idle_seconds", "perf/overlap_fraction"}
        assert 0.0 <= perf["perf/overlap_fraction"] <= 1.0
    # step 0 generates in the foreground (version 0); step t + 1's samples come from the weights of version t
    assert taken == [(0, 0.0, 0.0), (0, 1.0, 1.0), (1, 1.0, 2.0), (2, 1.0, 3.0)]
    assert [(step, weights) for step, _, weights, _ in phase.calls] == [(0, 0), (1, 0), (2, 1), (3, 2)]
    assert phase.calls[0][3] == threading.current_thread().name  # only step 0 runs on the trainer's thread
    assert all(thread == f"rollout-step-{step}" for step, _, _, thread in phase.calls[1:])
    assert len(phase.calls) == 4  # nothing is generated past the last step


def test_an_update_rolled_back_leaves_the_queued_rollout_on_policy():
    """MIPU's gate rejects step 1's update: the rollback restores the weights that sampled step 2's queued rollout, so
    step 2 trains on it (not regenerated) with staleness 0; the version advances again with step 2's kept update."""
    schedule, phase, engine = _schedule("one_step_off", last_step=4)
    staleness = []
    for step, kept in enumerate([True, False, True, True]):
        staleness.append(schedule.take(step).metrics["async/staleness_mean"])
        _train(schedule, engine, step, kept=kept)
    assert staleness == [0.0, 1.0, 0.0, 1.0]
    assert [(step, weights) for step, _, weights, _ in phase.calls] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert schedule.version == 3  # three of the four updates kept


def test_a_resumed_one_step_off_run_trains_every_prompt_of_the_epoch_once():
    """A checkpoint after step 1 saves the sampler from before step 2's rollout (already generated): the resumed
    run draws those prompts again, so over both runs each prompt of the epoch is trained exactly once."""
    schedule, phase, engine = _schedule("one_step_off")
    trained = []
    for step in range(2):
        trained += [group[0] for group in schedule.take(step).groups]
        _train(schedule, engine, step)
    saved = schedule.sampler_state()
    assert phase.ahead_calls[-1] == "drain_ahead"  # what the checkpoint reads of the anchor cache stands still
    assert phase.calls[-1][0] == 2  # step 2's rollout was generated ahead and is lost with the process
    sampler = PromptSampler(ROWS, 3, seed=0)
    sampler.load_state_dict(saved)
    resumed, resumed_phase, engine = _schedule("one_step_off", sampler=sampler)
    for step in range(2, 4):
        trained += [group[0] for group in resumed.take(step).groups]
        _train(resumed, engine, step)
    assert sorted(trained) == list(range(12))
    assert resumed_phase.calls[0][:2] == (2, phase.calls[-1][1])  # the same prompts, regenerated


def test_discarding_the_queued_rollout_draws_its_prompts_again():
    schedule, phase, engine = _schedule("one_step_off")
    schedule.take(0)
    _train(schedule, engine, 0)
    queued_prompts = phase.calls[-1][1]
    schedule.discard_queued()  # e.g. a reference reset: its anchors were the old reference's
    assert phase.ahead_calls[-1] == "drop_ahead"
    rollout = schedule.take(1)
    assert [group[0] for group in rollout.groups] == queued_prompts
    assert rollout.version == 1 and phase.calls[-2][3] == threading.current_thread().name  # regenerated, new weights


def test_a_failed_background_rollout_fails_the_step_that_waits_for_it():
    schedule, phase, engine = _schedule("one_step_off")
    phase.fail_at = 1
    schedule.take(0)
    with pytest.raises(RuntimeError, match="the rollout of step 1, generated ahead, failed: engine died"):
        _train(schedule, engine, 0)
