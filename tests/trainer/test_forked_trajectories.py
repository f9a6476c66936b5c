"""A trajectory forked on drift (rollout.agentic.on_drift fork: several samples tied by `Sample.trajectory`) counts
once beyond ARMOR's groups too: in MIPU's update gate (advantages, reward mean and T_post over trajectories) and in
the evaluation of an agentic dataset (one record per trajectory). The environment is the two-turn parity task, its
template the one that strips an earlier answer to its last character; the untrained tiny model's turns end at a
digit (its stop tokens here) or at the token limit, so a trajectory whose first turn stopped forks into two samples
and one cut in its first turn stays one (tests/trainer/test_agentic_run.py trains on forked trajectories)."""

import statistics
from pathlib import Path

import pytest

from megatron_armor.agentic.driver import load_rollout
from megatron_armor.config import AgenticConfig, MicroBatchingConfig, MipuConfig
from megatron_armor.convert.loading import load_gpt_model
from megatron_armor.data.datasets import PromptRow
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed
from megatron_armor.evaluation.settings import EvalDataset
from megatron_armor.models.hf_config import load_model_shape
from megatron_armor.models.tiny import make_char_tokenizer
from megatron_armor.rollout.base import SamplingParams
from megatron_armor.rollout.local import LocalEngine
from megatron_armor.scoring.logprobs import ScoringConfig
from megatron_armor.scoring.micro_batches import MicroBatching
from megatron_armor.trainer.rollouts.trajectories import TrajectoryScorer
from megatron_armor.trainer.step.validation import EvalSet, evaluate_set
from megatron_armor.trainer.update import update_gate
from megatron_armor.trainer.update.update_gate import InferenceGapGate

TASK = Path(__file__).parent / "agentic_task"
TOKENIZER = make_char_tokenizer()
DIGITS = tuple(TOKENIZER.convert_tokens_to_ids(list("0123456789")))
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=5)
ROWS = [PromptRow(i, TOKENIZER.encode(f"{i}+{i + 1}="), {"prompt": f"{i}+{i + 1}="}) for i in range(4)]


@pytest.fixture(scope="module")
def checkpoint(tiny_model_factory):
    return tiny_model_factory("qwen2")


def forking_scorer() -> TrajectoryScorer:
    """Trajectories of the parity task forked on drift, their turns ended by a digit."""
    environment = f"{TASK / 'two_turns.py'}:TwoTurnParity"
    tokenizer = make_char_tokenizer()
    tokenizer.chat_template = (TASK / "char_chat_strip.jinja").read_text()
    settings = AgenticConfig(environment=environment, on_drift="fork")
    return TrajectoryScorer(tokenizer, load_rollout(settings), settings, stop_token_ids=DIGITS, in_process=True)


def by_trajectory(samples) -> list[list]:
    """The samples of each trajectory (its prompt's and its number's), in order of first appearance."""
    trajectories: dict[tuple, list] = {}
    for sample in samples:
        trajectories.setdefault((sample.prompt_index, sample.trajectory), []).append(sample)
    return list(trajectories.values())


def test_mipu_gate_counts_a_forked_trajectory_once(checkpoint, monkeypatch):
    """The gate measures the engine of the actor's own weights (the in-process engine of the checkpoint the Megatron
    actor loads), so rho = 1 to the fp32 floor and T_post = -mean over trajectories of their advantages, zero when
    each prompt's are normalised over its trajectories (mipu.md §3); counting each segment instead would give minus
    their mean over segments, computed here (statistics' mean and sample std per prompt), far from zero. reward_mean
    is the trajectories' mean, not the segments'."""
    gated = []

    def recording(*args, **kwargs):
        samples = generate_samples(*args, **kwargs)
        gated.extend(samples)
        return samples

    generate_samples = update_gate.generate_samples
    monkeypatch.setattr(update_gate, "generate_samples", recording)
    gate = InferenceGapGate(MipuConfig(gate_prompts=4, gate_n=4), ROWS, forking_scorer(), SAMPLING, seed=0,
                            adv_eps=1e-6)
    initialize_distributed(1, 1, 1)
    try:
        actor = load_gpt_model(checkpoint, load_model_shape(checkpoint))
        result = gate.measure(0, actor, LocalEngine(checkpoint, pad_token_id=0), pad_token_id=0,
                              micro_batching=MicroBatching(MicroBatchingConfig(8)), scoring=ScoringConfig())
    finally:
        destroy_distributed()

    trajectories = by_trajectory(gated)
    assert len(trajectories) == 16 and {len(t) for t in trajectories} == {1, 2}  # forked and not
    rewards = [t[0].reward for t in trajectories]
    assert result.reward_mean == pytest.approx(statistics.mean(rewards), abs=1e-6)
    assert result.reward_mean != pytest.approx(statistics.mean(s.reward for s in gated), abs=1e-3)

    advantage = {}
    for prompt in {t[0].prompt_index for t in trajectories}:
        group = [t for t in trajectories if t[0].prompt_index == prompt]
        mean, std = statistics.mean(t[0].reward for t in group), statistics.stdev(t[0].reward for t in group)
        advantage.update({id(t): (t[0].reward - mean) / (std + 1e-6) for t in group})
    per_segment = -statistics.mean(advantage[id(t)] for t in trajectories for _ in t)
    assert abs(per_segment) > 0.05
    assert abs(result.gap) < 1e-5 and result.accepted


def test_evaluation_records_a_forked_trajectory_once(checkpoint, monkeypatch):
    """An agentic dataset rolled out with forks has one record per (prompt, sample): its reward the trajectory's, its
    length all its segments' response tokens, its turns the trajectory's; the dataset's metrics average records."""
    rolled_out = []
    scorer = forking_scorer()
    respond = scorer.respond_with_trajectories

    def recording(*args, **kwargs):
        answers = respond(*args, **kwargs)
        rolled_out.extend(answers)
        return answers

    monkeypatch.setattr(scorer, "respond_with_trajectories", recording)
    dataset = EvalDataset(name="forked", path="", n=4, max_new_tokens=SAMPLING.max_new_tokens,
                          agentic=scorer.settings)
    result = evaluate_set(LocalEngine(checkpoint, pad_token_id=0), EvalSet(dataset, ROWS, scorer, SAMPLING),
                          seed=(0,))

    assert {len(answer) for answer, _ in rolled_out} == {1, 2}  # forked and not
    assert [(r.prompt_id, r.sample) for r in result.records] == [(p, k) for p in range(4) for k in range(4)]
    lengths = [sum(len(s.response_ids) for s in answer) for answer, _ in rolled_out]
    assert [r.length for r in result.records] == lengths
    assert [r.reward for r in result.records] == [t.reward for _, t in rolled_out]
    assert [r.trajectory.turns for r in result.records] == [t.stats.turns for _, t in rolled_out]
    metrics = result.metrics
    assert metrics["avg@4"] == pytest.approx(statistics.mean(float(t.reward > 0) for _, t in rolled_out))
    assert metrics["reward_mean"] == pytest.approx(statistics.mean(t.reward for _, t in rolled_out))
    assert metrics["response_length"] == pytest.approx(statistics.mean(lengths))
    assert metrics["turns_mean"] == pytest.approx(statistics.mean(t.stats.turns for _, t in rolled_out))
