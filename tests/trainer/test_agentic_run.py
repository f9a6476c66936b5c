"""ARMOR on multi-turn trajectories through `armor train`'s code path (`run_training`, one process): the policy's
samples and the anchors are two-turn trajectories of an environment or of a rollout function of one's own
(tests/trainer/agentic_task/), the trained tokens are exactly those the policy sampled (checked against the
trajectories' own record), the trainer's logprobs equal the engine's to the fp32 floor, the agent/* metrics reach
metrics.jsonl, and a run resumed mid-way continues with the same metrics (each turn's sampling seed derives from its
request)."""

import statistics
from pathlib import Path

import pytest
import torch

from training_runs import resume_from, run_metrics

from megatron_armor.config import load_config
from megatron_armor.config.plugins import import_attribute
from megatron_armor.models.tiny import make_char_tokenizer
from megatron_armor.trainer.rollouts.trajectories import TrajectoryScorer
from megatron_armor.trainer.run.train import run_training
from megatron_armor.trainer.step import loop
from megatron_armor.trainer.update import training_batch

CONFIG = str(Path(__file__).parents[2] / "examples" / "tiny" / "armor.yaml")
TASK = Path(__file__).parent / "agentic_task"


def agentic_overrides(cache_dir: Path, run_dir: Path, steps: int, *, forked: bool = False) -> list[str]:
    """A small ARMOR run on the tiny task whose samples are trajectories of `TwoTurnArithmetic`; `forked`: rendered
    by a template that strips earlier answers, forked on drift."""
    template = "char_chat_strip.jinja" if forked else "char_chat.jinja"
    return [
        f"task.cache_dir={cache_dir}", f"logging.run_dir={run_dir}", f"train.max_steps={steps}",
        "task.num_train_rows=400", "task.num_val_rows=16", "eval.every=0", "eval.before_train=false",
        "checkpoint.every=100", "checkpoint.save_model=false", "logging.tensorboard=false", "logging.plot=false",
        "logging.progress_bar=false", "parallel.tensor_parallel_size=1", "rollout.sampling.n_samples=4",
        "rollout.anchors.ref_n=2", "armor.alpha=0.75", "train.train_batch_size=2", "train.gen_batch_size=4",
        "train.mini_batch_size=2", f"rollout.agentic.environment={TASK / 'two_turns.py'}:TwoTurnArithmetic",
        f"rollout.agentic.chat_template={TASK / template}", "rollout.agentic.max_turns=2",
        f"rollout.agentic.on_drift={'fork' if forked else 'keep'}",
    ]


def test_armor_trains_every_sampled_token_once_on_trajectories_forked_on_drift(synthetic_cache, tmp_path,
                                                                               monkeypatch):
    """rollout.agentic.on_drift fork under a template that keeps only the last character of an earlier answer
    (char_chat_strip.jinja: the character model's Qwen 3 dropping earlier reasoning; its arithmetic answers end with
    the result): a trajectory whose first answer is longer forks into two samples,
    and each sampled token is trained exactly once, in one of them, with the engine's logprob; a trajectory counts
    once in its group (ARMOR's anchor included: all its segments join), and its segments share its advantage, the
    group-normalised trajectory reward computed here."""
    trajectories, batches, built, step_groups = [], [], [], []
    roll_out, build = TrajectoryScorer._roll_out, training_batch.build_sequence_batch
    advantage_batch = loop.advantage_batch

    def recorded_roll_out(self, *args):
        trajectories.extend(result := roll_out(self, *args))
        return result

    def recorded_build(samples, advantages, **kwargs):
        built.append(dict(zip(map(id, samples), advantages, strict=True)))
        batches.append(batch := build(samples, advantages, **kwargs))
        return batch

    def recorded_advantage_batch(groups, *args, **kwargs):
        step_groups.append(groups)
        return advantage_batch(groups, *args, **kwargs)

    monkeypatch.setattr(TrajectoryScorer, "_roll_out", recorded_roll_out)
    monkeypatch.setattr(training_batch, "build_sequence_batch", recorded_build)
    monkeypatch.setattr(loop, "advantage_batch", recorded_advantage_batch)
    run_dir = tmp_path / "run"
    overrides = [*agentic_overrides(synthetic_cache, run_dir, 2, forked=True), "checkpoint.every=1"]
    assert run_training(load_config(CONFIG, overrides)) == 0

    rows = run_metrics(run_dir)
    for step in (1, 2):
        row = rows[step]
        assert row["mismatch/logprob_abs_diff"] < 1e-5  # the fp32 floor (~1e-7), far below any real mismatch
        assert row["armor/anchors_used"] == row["filter/prompts_kept"] > 0  # one anchor trajectory per group
        assert row["agent/turns_mean"] == 2.0 and row["agent/tool_calls_mean"] == 1.0
        assert row["agent/status_failed"] == row["agent/status_aborted"] == 0.0  # (a turn at its limit: truncated)
        assert 1 < row["agent/segments_mean"] <= 2 and row["agent/drift_turn_fraction"] > 0

    by_tokens = {}  # the segments by their tokens (an actor's and an anchor's may be equal, their logprobs not)
    vocabulary = len(make_char_tokenizer())
    for t in trajectories:
        assert len(t.segments) == 1 + (t.stats.drift_turns > 0)  # forked where the template dropped the first answer
        # the last segment renders as the template does, unless the policy sampled an id the tokenizer has no
        # character for (the tiny model's padded vocabulary rows: decoded as nothing)
        assert t.final_render_matches == all(i < vocabulary for i in t.segments[-1].token_ids)
        for segment in t.segments:
            by_tokens.setdefault(tuple(segment.token_ids), []).append(segment)
    trained = set()  # the segments trained, each in its own row
    for batch in batches:
        for row in range(batch.size):
            length = int(batch.seq_lengths[row])
            # label t is token t + 1: the trained labels are exactly the tokens the policy sampled, with the engine's
            # logprobs of them (0 elsewhere)
            labels = ((batch.response_mask[row, :length] == 1).nonzero().flatten() + 1).tolist()
            logprobs = batch.engine_logprobs[row, :length]
            matches = [s for s in by_tokens[tuple(batch.input_ids[row, :length].tolist())]
                       if labels == [j for j, m in enumerate(s.loss_mask) if m]
                       and torch.equal(logprobs[:-1], torch.tensor(s.logprobs[1:])) and logprobs[-1] == 0]
            trained.add(next(id(s) for s in matches if id(s) not in trained))
    assert len(trained) == sum(b.size for b in batches) > 0
    # a second segment starts from the template's render, the first answer cut to its last character (its sampled
    # tokens are trained in the first segment only): the prompt, that character, the end of the turn, the tool
    # message ("\n" + the prompt)
    tokenizer = make_char_tokenizer()
    forked = [t.segments for t in trajectories if len(t.segments) == 2]
    assert forked
    for first, second in forked:
        prompt, answer = first.token_ids[:first.prompt_length], first.token_ids[first.prompt_length:]
        kept = tokenizer.encode(tokenizer.decode(answer, skip_special_tokens=True)[-1:])
        assert second.token_ids[:second.prompt_length] == [*prompt, *kept, tokenizer.eos_token_id,
                                                           *tokenizer.encode("\n"), *prompt]

    assert len(step_groups) == len(built) == 2
    for groups, advantages in zip(step_groups, built):
        for group in groups:
            # the group's trajectories, told apart here by their prompts: a trajectory's first sample has the row's
            # prompt, a second segment the longer render of the conversation so far
            starts = [i for i, s in enumerate(group) if s.prompt_ids == group[0].prompt_ids]
            members = [group[a:b] for a, b in zip(starts, [*starts[1:], len(group)])]
            # actor_n (n_samples less the anchor's place) and one anchor
            assert sum(not m[0].is_anchor for m in members) == 3 and members[-1][0].is_anchor
            assert all(s.is_anchor for s in members[-1]) and members[-1][0].correct
            rewards = [m[0].reward for m in members]
            assert all(s.reward == m[0].reward for m in members for s in m)
            mean, std = statistics.mean(rewards), statistics.stdev(rewards)
            for m, reward in zip(members, rewards):
                for s in m:
                    assert advantages[id(s)] == pytest.approx((reward - mean) / (std + 1e-6), abs=1e-6)
        assert sum(map(len, groups)) == len(advantages)  # every sample of the kept groups trained

    resumed = tmp_path / "resumed"
    resume_from(run_dir, resumed, 1)
    assert run_training(load_config(CONFIG, agentic_overrides(synthetic_cache, resumed, 2, forked=True)),
                        resume=True) == 0
    timings = ("perf/", "agent/generation_s_mean", "agent/tool_s_mean")
    # The in-process engine batches the turns waiting together (which ones: timing), and its logprobs round by batch
    # size: the engine-trainer mismatch moves at the fp32 floor; the samples, the loss and the rest are exact.
    floor = ("mismatch/",)
    deterministic = [key for key in rows[2] if not key.startswith(timings + floor)]
    resumed_row = run_metrics(resumed)[2]
    assert {k: resumed_row[k] for k in deterministic} == {k: rows[2][k] for k in deterministic}
    for key in (key for key in rows[2] if key.startswith(floor)):
        assert resumed_row[key] == pytest.approx(rows[2][key], abs=1e-7), key


def test_armor_trains_the_tokens_a_rollout_function_sampled_and_monitors_and_audits_its_trajectories(
        synthetic_cache, tmp_path, monkeypatch):
    """rollout.agentic.rollout_fn: every sample and anchor is a trajectory of a user's async function that drives
    `ctx.generate` itself for two turns (agentic_task/two_turn_rollout.py); the trained tokens are exactly the tokens
    it sampled, with the engine's logprobs. The collapse monitor and an audit verifier (validation every step) run on
    those trajectories: `never` calls every trajectory wrong, so its hack rate is the fraction the trajectories' own
    reward calls correct, and the monitor's hack-rate alarm (threshold 0, a window of one step) fires on it."""
    helper = TASK / "two_turn_rollout.py"
    record = import_attribute(f"{helper}:SAMPLED", "the rollout function's record")
    record.clear()
    batches, build = [], training_batch.build_sequence_batch

    def recorded_build(samples, advantages, **kwargs):
        batches.append(batch := build(samples, advantages, **kwargs))
        return batch

    monkeypatch.setattr(training_batch, "build_sequence_batch", recorded_build)
    audits = tmp_path / "audits.py"
    audits.write_text("def never(response, row):\n    return 0.0, False\n")
    run_dir = tmp_path / "run"
    overrides = [o for o in agentic_overrides(synthetic_cache, run_dir, 1)
                 if not o.startswith("rollout.agentic.environment=")]
    overrides += [f"rollout.agentic.rollout_fn={helper}:two_turns", "eval.every=1", "eval.max_prompts=2",
                  f"reward.audit_fns=[{audits}:never]", "monitor.enabled=true", "monitor.window=1", "monitor.hack_rate=0.0"]
    assert run_training(load_config(CONFIG, overrides)) == 0

    row = run_metrics(run_dir)[1]
    assert row["agent/turns_mean"] == 2.0 and row["agent/tool_calls_mean"] == 1.0
    assert row["mismatch/logprob_abs_diff"] < 1e-5 and row["armor/anchors_used"] > 0
    assert row["audit/audits_never_accuracy"] == 0.0
    assert row["audit/audits_never_hack_rate"] == row["audit/hack_rate"] == row["train/accuracy"] > 0
    assert row["monitor/val_best"] == row["val/accuracy"] and row["monitor/alarm_hack_rate"] == 1.0
    by_tokens = {}
    for tokens, turns in record:
        by_tokens.setdefault(tuple(tokens), []).append(turns)
    for batch in batches:
        for i in range(batch.size):
            length = int(batch.seq_lengths[i])
            tokens = batch.input_ids[i, :length]
            labels = (batch.response_mask[i, :length] == 1).nonzero().flatten() + 1  # label t is token t + 1
            # the tokens trained, and the engine logprobs they carry, are the function's turns' sampled ones in order
            assert any(tokens[labels].tolist() == [t for ids, _ in turns for t in ids]
                       and torch.equal(batch.engine_logprobs[i, labels - 1],
                                       torch.tensor([lp for _, lps in turns for lp in lps]))
                       for turns in by_tokens[tuple(tokens.tolist())])
    assert sum(batch.size for batch in batches) > 0


@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_grpo_kl_trains_on_trajectories_in_overlapped_rollouts(synthetic_cache, tmp_path, monkeypatch, mode):
    """The overlapped rollout modes roll trajectories out on their background thread (an event loop of its own per
    generation batch), async with partial rollouts (the actor's engine paused by each push; an interrupted turn goes
    on under the new weights, every token with its version; its trajectories forked on drift, each segment with the
    versions of its own tokens); GRPO + KL scores them with the reference on the sampled tokens."""
    run_dir = tmp_path / "run"
    overrides = [*agentic_overrides(synthetic_cache, run_dir, 2, forked=mode == "async"), "algorithm.name=grpo_kl",
                 "kl.coef=0.01", "rollout.sampling.actor_n=4", f"rollout.mode={mode}", "rollout.max_staleness=1",
                 # forked, the warm-started policy answers nearly every prompt right in one of its two tries: a
                 # reward of the answers' parity mixes the groups
                 *([f"rollout.agentic.environment={TASK / 'two_turns.py'}:TwoTurnParity"] if mode == "async" else []),
                 f"rollout.partial_rollouts={mode == 'async'}"]
    assert run_training(load_config(CONFIG, overrides)) == 0
    rows = run_metrics(run_dir)
    for step in (1, 2):
        row = rows[step]
        assert row["agent/status_aborted"] == row["agent/status_failed"] == 0.0  # an interrupted turn goes on
        if mode == "one_step_off":  # sampled by known weights: every trajectory plays its two turns to the end
            assert row["agent/turns_mean"] == 2.0 and row["agent/status_completed"] == 1.0
        else:  # which weights sample a token is timing under partial rollouts: a turn may reach its token limit
            assert 1.0 < row["agent/turns_mean"] <= 2.0
            assert row["agent/status_completed"] + row["agent/status_truncated"] == 1.0
        assert row["train/update_skipped"] == 0.0 and "armor/anchor_accuracy" not in row
        assert row["async/staleness_max"] <= 1
        assert ("async/partial_fraction" in row) == (mode == "async")  # logged with partial rollouts only
        assert (row["agent/segments_mean"] > 1) == (mode == "async")  # forked
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
