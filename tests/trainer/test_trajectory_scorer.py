"""The trainer's trajectory scorer on the in-process engine of a tiny model: the per-status actions (zero reward;
resample, and what is left once resamples run out) and rollouts reproducible from their seed whatever runs beside
them. (tests/trainer/test_agentic_run.py checks multi-turn samples and their loss masks in a training run.)"""

import dataclasses
from pathlib import Path

import pytest

from megatron_armor.agentic.environment import load_environment
from megatron_armor.config import AgenticConfig
from megatron_armor.data.datasets import PromptRow
from megatron_armor.models.tiny import make_char_tokenizer
from megatron_armor.rollout.base import SamplingParams
from megatron_armor.rollout.local import LocalEngine
from megatron_armor.trainer.rollouts.trajectories import TrajectoryScorer

TASK = Path(__file__).parent / "agentic_task"
FLAKY = f"{TASK / 'flaky.py'}:Flaky"
Flaky = load_environment(FLAKY)  # the class the scorer loads (a file is loaded once per process)
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=6)


def seeded(rows: list[PromptRow], first: int = 11) -> SamplingParams:
    """SAMPLING with a seed per row (first, first + 1, ...), as `generate_samples` gives a trajectory scorer."""
    return dataclasses.replace(SAMPLING, seeds=tuple(range(first, first + len(rows))))


@pytest.fixture
def engine(tiny_model_factory):
    return LocalEngine(tiny_model_factory("qwen2"), pad_token_id=0)


def scorer(**settings) -> TrajectoryScorer:
    Flaky.attempts.clear()
    config = AgenticConfig(environment=FLAKY, chat_template=str(TASK / "char_chat.jinja"), **settings)
    return TrajectoryScorer.load(config, make_char_tokenizer(), in_process=True)


def prompts(*rows: dict) -> list[PromptRow]:
    tokenizer = make_char_tokenizer()
    return [PromptRow(i, tokenizer.encode(r["prompt"]), r) for i, r in enumerate(rows)]


def test_zero_reward_action_keeps_the_tokens_and_drops_the_reward(engine):
    """A turn cut at its token limit ends the trajectory truncated, one that samples the stop token completed."""
    actions = dict(on_completed="zero_reward", on_truncated="zero_reward")
    rows = prompts({"prompt": "3="})
    [[sample]] = scorer(**actions).respond(engine, rows, seeded(rows), is_anchor=False)
    assert sample.reward == 0.0 and not sample.correct and sample.loss_mask == [1] * len(sample.response_ids)
    [[kept]] = scorer().respond(engine, rows, seeded(rows), is_anchor=False)
    assert kept.reward == 1.0 and kept.correct and kept.response_ids == sample.response_ids


def test_resample_rolls_a_row_out_again_until_it_samples_and_gives_up_with_reward_zero(engine):
    rows = prompts({"prompt": "4=", "fail": 2}, {"prompt": "5=", "fail": 9}, {"prompt": "6="})
    answers = scorer(max_resamples=2).respond(engine, rows, seeded(rows), is_anchor=False)
    samples = [s for answer in answers for s in answer]
    assert Flaky.attempts == {"4=": 3, "5=": 3, "6=": 1}  # a failed reset samples nothing: rolled out again
    assert samples[0].reward == 1.0 and sum(samples[0].loss_mask) > 0  # the third attempt succeeded
    assert (samples[1].prompt_ids, samples[1].response_ids, samples[1].loss_mask, samples[1].reward) == (
        rows[1].prompt_ids, [], [], 0.0)  # out of resamples: trains nothing
    assert samples[2].reward == 1.0


def test_trajectories_depend_on_their_seed_only(engine):
    """A row's trajectory is the same rolled out alone or beside others (each turn its own seed, derived from the
    row's; batched with the others' turns, its logprobs to the fp32 floor), not with another seed; a scorer without a
    seed per row refuses to roll out."""
    rows = prompts(*({"prompt": f"{d}+{d}="} for d in range(3)))
    together = [s for [s] in scorer(max_in_flight=3).respond(engine, rows, seeded(rows), is_anchor=False)]
    [[alone]] = scorer(max_in_flight=1).respond(engine, rows[:1], seeded(rows[:1]), is_anchor=False)
    assert alone.engine_logprobs == pytest.approx(together[0].engine_logprobs, abs=1e-6, rel=0)
    assert dataclasses.replace(alone, engine_logprobs=[]) == dataclasses.replace(together[0], engine_logprobs=[])
    assert alone.response_ids != together[1].response_ids
    [[other_seed]] = scorer().respond(engine, rows[:1], seeded(rows[:1], first=12), is_anchor=False)
    assert other_seed.response_ids != alone.response_ids
    with pytest.raises(ValueError, match="trajectories are seeded per request: 1 prompts need as many sampling.seeds"):
        scorer().respond(engine, rows[:1], dataclasses.replace(SAMPLING, seed=11), is_anchor=False)


def test_per_request_seeds_give_a_trajectory_wherever_its_request_stands(engine):
    """Evaluation's per-request seeds (`SamplingParams.seeds`, one per prompt): a request's trajectory depends on its
    own seed only, so a data-parallel rank that answers it alone samples what one rank answering all of them does."""
    rows = prompts(*({"prompt": f"{d}+{d}="} for d in range(3)))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seeds=(5, 6, 7))
    together = [s for [s] in scorer().respond(engine, rows, sampling, is_anchor=False)]
    [[alone]] = scorer().respond(engine, rows[1:2], SamplingParams(temperature=1.0, max_new_tokens=6, seeds=(6,)),
                               is_anchor=False)
    # the same trajectory: its tokens, masks and reward exactly; its engine logprobs to the fp32 floor (the engine
    # batches the turns waiting together, and its products round by batch size)
    assert dataclasses.replace(alone, engine_logprobs=None) == dataclasses.replace(together[1], engine_logprobs=None)
    assert alone.engine_logprobs == pytest.approx(together[1].engine_logprobs, abs=1e-6)
    assert alone.reward == 1.0 and sum(alone.loss_mask) > 0  # sampled, not failed
    assert alone.response_ids != together[0].response_ids
