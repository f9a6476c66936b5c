"""Token-exact trajectories over four chat-template families (seeded random conversations): every sampled token is
trained exactly once with the engine's logprob, each turn was sampled from exactly the prefix the trainer sees, and
the final render check passes, or drift is handled as documented (agentic/trajectory.py)."""

from __future__ import annotations

import random

import pytest

from agentic_helpers import AddEnv, ScriptedPolicy, play
from megatron_armor.agentic.chat_templates import CHAT_FORMATS, make_chat_tokenizer
from megatron_armor.config import AgenticConfig
from megatron_armor.agentic.tools import tool_calls_text
from megatron_armor.agentic.trajectory import Segment, Status, TrajectoryBuilder, TurnCheck

WORDS = ["let", "me", "think", "about", "12", "+", "7", "the", "answer", "is", "step", "by"]
CONVERSATIONS = 25


@pytest.fixture(scope="module", params=sorted(CHAT_FORMATS))
def chat(request):
    tokenizer = make_chat_tokenizer(request.param)
    return request.param, tokenizer, tokenizer.convert_tokens_to_ids(CHAT_FORMATS[request.param].end_of_turn)


def random_turns(rng: random.Random, tokenizer, stop_id: int, *, think: bool, canonical: bool):
    """A conversation's policy turns: reasoning (when `think`), tool calls (parallel ones, sometimes malformed) until
    the last turn, which answers (sometimes cut at its token limit). `canonical`: each turn's ids are its text encoded
    at once; else some turns are encoded piece by piece (ids a re-encoding of the decoded text does not give back)."""
    turns = []
    n = rng.randint(1, 4)
    for k in range(n):
        text = f"<think>{' '.join(rng.choices(WORDS, k=rng.randint(1, 6)))}</think>\n" if (
            think and rng.random() < 0.6) else ""
        if k < n - 1:
            calls = [("add", {"a": rng.randint(0, 99), "b": rng.randint(0, 99)}) for _ in range(rng.randint(1, 3))]
            text += " ".join(rng.choices(WORDS, k=2)) + tool_calls_text(calls)
            if rng.random() < 0.15:
                text += '<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>'
        else:
            text += f"The answer is {rng.randint(0, 99)}."
        if canonical or rng.random() < 0.5:
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = [i for piece in text.split(" ") for i in tokenizer.encode(piece + " ", add_special_tokens=False)]
        cut = k == n - 1 and rng.random() < 0.2
        turns.append((ids, "length") if cut else (ids + [stop_id], "stop"))
    return turns


def assert_token_exact(trajectory, policy: ScriptedPolicy) -> None:
    """Every sampled token trained exactly once, in order, with its logprob; each call's prompt is the prefix of a
    segment that its sampled tokens follow (masked 1); masks and logprobs as long as the tokens, 0.0 where masked."""
    segments = trajectory.segments
    for s in segments:
        assert len(s.token_ids) == len(s.loss_mask) == len(s.logprobs) and s.loss_mask[-1] == 1
        assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.loss_mask) if not m)
    trained = [(t, lp) for s in segments for t, m, lp in zip(s.token_ids, s.loss_mask, s.logprobs) if m]
    assert trained == [(t, lp) for _, ids, lps in policy.calls for t, lp in zip(ids, lps)]
    index = 0
    for prompt, ids, _ in policy.calls:
        while segments[index].token_ids[:len(prompt)] != prompt:
            index += 1  # a later segment (a fork); IndexError if none holds the prompt
        span = slice(len(prompt), len(prompt) + len(ids))
        assert segments[index].token_ids[span] == ids and all(segments[index].loss_mask[span])


def reference_ids(tokenizer, messages, tools, add_generation_prompt=False) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tools=tools, tokenize=True,
                                              add_generation_prompt=add_generation_prompt)["input_ids"])


@pytest.mark.parametrize("canonical", [True, False], ids=["canonical", "re-encoding-drifts"])
@pytest.mark.parametrize("on_drift", ["keep", "fork"])
def test_random_conversations_are_token_exact(chat, canonical, on_drift):
    name, tokenizer, stop_id = chat
    rng = random.Random(f"{name}-{canonical}-{on_drift}")
    think = name == "chatml_strip_think" or rng.random() < 0.5
    statuses, drifted = set(), 0
    for seed in range(CONVERSATIONS):
        policy = ScriptedPolicy(random_turns(rng, tokenizer, stop_id, think=think, canonical=canonical), seed)
        (trajectory,) = play(policy, tokenizer, stop_id, limits=AgenticConfig(max_turns=8, on_drift=on_drift))
        statuses.add(trajectory.status)
        assert trajectory.status in (Status.COMPLETED, Status.TRUNCATED, Status.ABORTED), trajectory.error
        assert_token_exact(trajectory, policy)
        assert trajectory.stats.turns == len(policy.calls)
        drifted += trajectory.stats.drift_turns > 0
        if not canonical:
            continue
        assistants = [m for m in trajectory.messages if m["role"] == "assistant"]
        stripped = name == "chatml_strip_think" and any("</think>" in m["content"] for m in assistants[:-1])
        # The last segment is a prefix of the tokenizer's own full render unless a stripped reasoning was kept.
        assert trajectory.final_render_matches is not (stripped and on_drift == "keep")
        last = trajectory.segments[-1].token_ids
        full = reference_ids(tokenizer, trajectory.messages, AddEnv().tools)
        assert (full[:len(last)] == last) is trajectory.final_render_matches
        if on_drift == "keep" or not stripped:
            assert len(trajectory.segments) == 1
        assert trajectory.stats.drift_turns == len(trajectory.segments) - 1 or on_drift == "keep"
    assert Status.COMPLETED in statuses
    # drift comes exactly from the re-encoded turns and the stripped reasoning, and is then seen
    assert (drifted > 0) == (not canonical or name == "chatml_strip_think")


def test_the_first_segment_is_the_tokenizers_own_render(chat):
    """The prompt and every clean turn's delta give exactly the ids of transformers' apply_chat_template over the
    conversation (an independent render), tools included."""
    name, tokenizer, stop_id = chat
    text = "sum first" + tool_calls_text([("add", {"a": 2, "b": 3}), ("add", {"a": 4, "b": 5})])
    turns = [(tokenizer.encode(text, add_special_tokens=False) + [stop_id], "stop"),
             (tokenizer.encode("The answer is 14.", add_special_tokens=False) + [stop_id], "stop")]
    policy = ScriptedPolicy(turns)
    (trajectory,) = play(policy, tokenizer, stop_id)
    tools, messages = AddEnv().tools, trajectory.messages
    assert [m["content"] for m in messages if m["role"] == "tool"] == ["5", "9"]
    (segment,) = trajectory.segments
    assert policy.calls[1][0] == reference_ids(tokenizer, messages[:-1], tools, add_generation_prompt=True)
    full = reference_ids(tokenizer, messages, tools)
    assert segment.token_ids == full[:len(segment.token_ids)]
    assert trajectory.status is Status.COMPLETED and trajectory.final_render_matches


def test_builder_realigns_a_delta_tokenized_differently_and_forks_or_keeps_on_drift():
    """Hand-made ids: a canonical render that differs only after the last sampled token replaces the delta
    (realign); one that differs inside a sampled span keeps the exact ids or forks, each sampled token once."""
    builder = TrajectoryBuilder([1, 2], on_drift="keep")
    builder.add_sampled([3, 4], [-0.1, -0.2])
    assert builder.add_context([5, 6], canonical=[1, 2, 3, 4, 5, 6]) is TurnCheck.CLEAN
    builder.add_sampled([7], [-0.3])
    assert builder.add_context([8, 9], canonical=[1, 2, 3, 4, 5, 6, 7, 10]) is TurnCheck.REALIGN
    assert builder.prompt == [1, 2, 3, 4, 5, 6, 7, 10]
    assert builder.add_context([11], canonical=[1, 2, 99]) is TurnCheck.DRIFT
    assert builder.segments == [Segment([1, 2, 3, 4, 5, 6, 7, 10, 11], [0, 0, 1, 1, 0, 0, 1, 0, 0],
                                        [0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3, 0.0, 0.0])]
    assert not builder.finish([1, 2, 3])
    fork = TrajectoryBuilder([1, 2], on_drift="fork")
    fork.add_sampled([3], [-0.5])
    assert fork.add_context([4], canonical=[1, 2, 30, 4]) is TurnCheck.FORK
    fork.add_sampled([5], [-0.6])
    assert fork.segments == [Segment([1, 2, 3], [0, 0, 1], [0.0, 0.0, -0.5]),
                             Segment([1, 2, 30, 4, 5], [0, 0, 0, 0, 1], [0.0] * 4 + [-0.6])]
    assert fork.finish([1, 2, 30, 4, 5, 6])
    assert [s.prompt_length for s in fork.segments] == [2, 4]


def test_trained_segments_end_at_their_last_sampled_token_and_untrained_ones_go():
    """A trajectory that ends after context was appended (a limit hit before the next turn) does not train on it; a
    segment forked and never sampled from is dropped."""
    builder = TrajectoryBuilder([1], on_drift="fork")
    builder.add_sampled([2], [-0.2])
    builder.add_context([3, 4], canonical=[1, 2, 3, 4])
    builder.add_sampled([5], [-0.5])
    builder.add_context([6], canonical=[9, 9])  # drift: forks
    assert builder.trained_segments() == [Segment([1, 2, 3, 4, 5], [0, 1, 0, 0, 1], [0.0, -0.2, 0.0, 0.0, -0.5])]
    builder = TrajectoryBuilder([1], on_drift="keep")
    builder.add_sampled([2], [-0.2])
    builder.add_context([3, 4], canonical=[1, 2, 3, 4])
    assert builder.trained_segments() == [Segment([1, 2], [0, 1], [0.0, -0.2])]


def test_weight_versions_follow_the_sampled_tokens_and_context_takes_the_turn_before_it():
    """Partial rollouts: a turn's tokens carry the versions that drew them (a push mid-turn: two); a context token
    after a turn has the version of the turn's last token; a segment's sampled tokens all have versions or none."""
    builder = TrajectoryBuilder([1, 2])
    builder.add_sampled([3, 4], [-0.1, -0.2], versions=[0, 1])
    builder.add_context([5, 6], canonical=[1, 2, 3, 4, 5, 6])
    builder.add_sampled([7], [-0.3], versions=[2])
    builder.add_context([8], canonical=[1, 2, 3, 4, 5, 6, 7, 8])
    (segment,) = builder.trained_segments()
    assert segment.sampled_versions == [0, 1, 2] and segment.response_versions() == [0, 1, 1, 1, 2]
    assert Segment([1, 2], [0, 1], [0.0, -0.1]).response_versions() is None  # an engine without versions
    with pytest.raises(ValueError, match="every sampled token of a segment has a weight version, or none has"):
        builder.add_sampled([9], [-0.4])
    with pytest.raises(ValueError, match="2 weight versions for 1 sampled tokens"):
        builder.add_sampled([9], [-0.4], versions=[3, 3])
