"""ARMOR on multi-turn trajectories through `armor train`'s code path (`run_training`, one process): the policy's
samples and the anchors are two-turn trajectories of an environment (tests/trainer/agentic_task/), the trained tokens
are exactly those the policy sampled (checked against the trajectories' own record), the trainer's logprobs equal the
engine's to the fp32 floor, the agent/* metrics reach metrics.jsonl, and a run resumed mid-way continues with the
same metrics (each turn's sampling seed derives from its request)."""

from pathlib import Path

import pytest
import torch

from training_runs import resume_from, run_metrics

from megatron_armor.config import load_config
from megatron_armor.models.tiny import make_char_tokenizer
from megatron_armor.trainer.rollouts.trajectories import TrajectoryScorer
from megatron_armor.trainer.run.train import run_training
from megatron_armor.trainer.update import training_batch

CONFIG = str(Path(__file__).parents[2] / "examples" / "tiny" / "armor.yaml")
TASK = Path(__file__).parent / "agentic_task"


def agentic_overrides(cache_dir: Path, run_dir: Path, steps: int) -> list[str]:
    """A small ARMOR run on the tiny task whose samples are trajectories of `TwoTurnArithmetic`."""
    return [
        f"task.cache_dir={cache_dir}", f"logging.run_dir={run_dir}", f"train.max_steps={steps}",
        "task.num_train_rows=400", "task.num_val_rows=16", "eval.every=0", "eval.before_train=false",
        "checkpoint.every=100", "checkpoint.save_model=false", "logging.tensorboard=false", "logging.plot=false",
        "logging.progress_bar=false", "parallel.tensor_parallel_size=1", "rollout.sampling.n_samples=4",
        "rollout.anchors.ref_n=2", "armor.alpha=0.75", "train.train_batch_size=2", "train.gen_batch_size=4",
        "train.mini_batch_size=2", f"rollout.agentic.environment={TASK / 'two_turns.py'}:TwoTurnArithmetic",
        f"rollout.agentic.chat_template={TASK / 'char_chat.jinja'}", "rollout.agentic.max_turns=2",
    ]


def test_armor_trains_exactly_the_sampled_tokens_of_multi_turn_trajectories(synthetic_cache, tmp_path, monkeypatch):
    trajectories, batches = [], []
    roll_out, build = TrajectoryScorer._roll_out, training_batch.build_sequence_batch

    def recorded_roll_out(self, *args):
        trajectories.extend(result := roll_out(self, *args))
        return result

    def recorded_build(*args, **kwargs):
        batches.append(batch := build(*args, **kwargs))
        return batch

    monkeypatch.setattr(TrajectoryScorer, "_roll_out", recorded_roll_out)
    monkeypatch.setattr(training_batch, "build_sequence_batch", recorded_build)
    run_dir = tmp_path / "run"
    overrides = [*agentic_overrides(synthetic_cache, run_dir, 2), "checkpoint.every=1"]
    assert run_training(load_config(CONFIG, overrides)) == 0

    rows = run_metrics(run_dir)
    for step in (1, 2):
        row = rows[step]
        assert row["mismatch/logprob_abs_diff"] < 1e-5  # the fp32 floor (~1e-7), far below any real mismatch
        assert row["armor/anchors_used"] == row["filter/prompts_kept"] > 0
        assert row["agent/turns_mean"] == 2.0 and row["agent/tool_calls_mean"] == 1.0
        assert row["agent/status_completed"] == 1.0
        assert 0 < row["agent/trainable_token_fraction"] < 1

    by_tokens = {}  # the sampled segments by their tokens (an actor's and an anchor's may be equal, their logprobs not)
    for t in trajectories:
        by_tokens.setdefault(tuple(t.segments[0].token_ids), []).append(t.segments[0])
    assert by_tokens and all(len(t.segments) == 1 for t in trajectories)
    # the final render check passes unless the policy sampled an id the tokenizer has no character for (the tiny
    # model's padded vocabulary rows: decoded as nothing, so the render lacks them; kept token-exact as drift)
    vocabulary = len(make_char_tokenizer())
    for t in trajectories:
        assert t.final_render_matches == all(i < vocabulary for i in t.segments[0].token_ids)
    checked = 0
    for batch in batches:
        for row in range(batch.size):
            length = int(batch.seq_lengths[row])
            # label t is token t + 1: the trained labels are exactly the tokens the policy sampled, with the engine's
            # logprobs of them (0 elsewhere)
            trained = ((batch.response_mask[row, :length] == 1).nonzero().flatten() + 1).tolist()
            logprobs = batch.engine_logprobs[row, :length]
            matches = [s for s in by_tokens[tuple(batch.input_ids[row, :length].tolist())]
                       if trained == [j for j, m in enumerate(s.loss_mask) if m]
                       and torch.equal(logprobs[:-1], torch.tensor(s.logprobs[1:])) and logprobs[-1] == 0]
            assert matches
            # the tool message between the turns is in the sequence and not trained
            assert 0 in matches[0].loss_mask[matches[0].prompt_length:]
            checked += 1
    assert checked == sum(b.size for b in batches) > 0

    resumed = tmp_path / "resumed"
    resume_from(run_dir, resumed, 1)
    assert run_training(load_config(CONFIG, agentic_overrides(synthetic_cache, resumed, 2)), resume=True) == 0
    timings = ("perf/", "agent/generation_s_mean", "agent/tool_s_mean")
    # The in-process engine batches the turns waiting together (which ones: timing), and its logprobs round by batch
    # size: the engine-trainer mismatch moves at the fp32 floor; the samples, the loss and the rest are exact.
    floor = ("mismatch/",)
    deterministic = [key for key in rows[2] if not key.startswith(timings + floor)]
    resumed_row = run_metrics(resumed)[2]
    assert {k: resumed_row[k] for k in deterministic} == {k: rows[2][k] for k in deterministic}
    for key in (key for key in rows[2] if key.startswith(floor)):
        assert resumed_row[key] == pytest.approx(rows[2][key], abs=1e-7), key


@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_grpo_kl_trains_on_trajectories_in_overlapped_rollouts(synthetic_cache, tmp_path, monkeypatch, mode):
    """The overlapped rollout modes roll trajectories out on their background thread (an event loop of its own per
    generation batch), async with partial rollouts (the actor's engine paused by each push; an interrupted turn goes
    on under the new weights, every token with its version); GRPO + KL scores them with the reference on the sampled
    tokens."""
    run_dir = tmp_path / "run"
    overrides = [*agentic_overrides(synthetic_cache, run_dir, 2), "algorithm.name=grpo_kl", "kl.coef=0.01",
                 "rollout.sampling.actor_n=4", f"rollout.mode={mode}", "rollout.max_staleness=1",
                 f"rollout.partial_rollouts={mode == 'async'}"]
    assert run_training(load_config(CONFIG, overrides)) == 0
    rows = run_metrics(run_dir)
    for step in (1, 2):
        row = rows[step]
        assert row["agent/turns_mean"] == 2.0 and row["agent/status_completed"] == 1.0
        assert row["train/update_skipped"] == 0.0 and "armor/anchor_accuracy" not in row
        assert row["async/staleness_max"] <= 1
        assert ("async/partial_fraction" in row) == (mode == "async")  # logged with partial rollouts only
    assert rows[1]["mismatch/logprob_abs_diff"] < 1e-5  # the first batch was sampled by the weights it trains
    assert rows[1]["loss/kl_to_ref"] == 0.0 < rows[2]["loss/kl_to_ref"]  # the actor leaves the reference


@pytest.mark.parametrize("algorithm", ["mipu", "opd"])
def test_mipu_and_opd_train_on_trajectories(synthetic_cache, tmp_path, monkeypatch, algorithm):
    """MIPU's update gate measures the engine on trajectories of held-out prompts, as the step samples them (every
    trajectory rolled out beyond the step's own is the gate's); OPD's teacher scores the student's trajectories (the
    untrained student: its turns mostly run to their token limit, ending the trajectory truncated)."""
    rolled_out = []
    roll_out = TrajectoryScorer._roll_out

    def counted_roll_out(self, engine, rows, *args):
        rolled_out.extend(rows)
        return roll_out(self, engine, rows, *args)

    monkeypatch.setattr(TrajectoryScorer, "_roll_out", counted_roll_out)
    options = {"mipu": ["mipu.gate_prompts=2", "mipu.gate_n=3", "algorithm.clip_high=null", "algorithm.dual_clip=null"],
               "opd": ["algorithm.filter_groups=false"]}[algorithm]
    run_dir = tmp_path / "run"
    overrides = [*agentic_overrides(synthetic_cache, run_dir, 1), f"algorithm.name={algorithm}",
                 "rollout.sampling.actor_n=4", *options]
    assert run_training(load_config(CONFIG, overrides)) == 0
    row = run_metrics(run_dir)[1]
    assert row["train/update_skipped"] == 0.0 and row["agent/trainable_token_fraction"] > 0
    assert row["mismatch/logprob_abs_diff"] < 1e-5
    if algorithm == "mipu":
        assert row["mipu/accepted"] in (0.0, 1.0) and abs(row["mipu/gap_proxy"]) < float("inf")
        assert len(rolled_out) == row["filter/prompts_generated"] * 4 + 2 * 3  # the step's, then the gate's
    else:
        assert row["opd/reverse_kl"] > 0 and row["agent/status_truncated"] > 0
