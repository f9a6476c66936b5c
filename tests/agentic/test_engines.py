"""Multi-turn rollouts on real engines, token ids in and out: the in-process LocalEngine and the SGLang client
against an `armor serve-local` server process. A low-level rollout function (the API for users who write their own
loop) plays three turns; the logprob of every trained token equals a fresh forward pass of the same checkpoint over
the trajectory's tokens (what the trainer will compute), and under partial rollouts a forward pass of the weights that
drew it."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_armor.agentic.chat_templates import make_chat_tokenizer
from megatron_armor.agentic.driver import RolloutContext, run_rollouts
from megatron_armor.agentic.generate import EngineGenerator
from megatron_armor.agentic.render import ChatRenderer
from megatron_armor.agentic.trajectory import Status, Trajectory, TrajectoryBuilder, TrajectoryStats
from megatron_armor.rollout.base import SamplingParams
from megatron_armor.rollout.local import LocalEngine
from megatron_armor.rollout.pausable import PausableEngine
from megatron_armor.rollout.sglang_engine import SGLangEngine, SGLangEngineConfig
from megatron_armor.utils.net import free_port

TURNS = 3
ROWS = [{"prompt": f"{a}+{a}="} for a in range(4)]


async def three_turns(ctx: RolloutContext, row: dict) -> Trajectory:
    """A user simulator says "Go on." after each turn, whatever the policy wrote (a turn cut at its token limit
    included: the template's footer closes it)."""
    renderer = ChatRenderer(ctx.tokenizer, ctx.sampling.stop_token_ids)
    messages = [{"role": "user", "content": row["prompt"]}]
    builder, stats = TrajectoryBuilder(renderer.ids(messages, generation_prompt=True)), TrajectoryStats()
    for turn in range(TURNS):
        sampled = await ctx.generate(builder.prompt)
        builder.add_sampled(sampled.token_ids, sampled.logprobs, sampled.versions)
        messages.append(renderer.assistant_message(sampled.token_ids))
        stats.turns += 1
        if turn < TURNS - 1:
            new = [{"role": "user", "content": "Go on."}]
            messages += new
            builder.add_context(renderer.continuation(sampled.token_ids, new),
                                renderer.ids(messages, generation_prompt=True))
    return Trajectory(row, builder.trained_segments(), Status.COMPLETED, 0.0, [], messages, stats)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen2", vocab_size=384)


@pytest.fixture(scope="module")
def tokenizer():
    return make_chat_tokenizer("chatml")


def play(generator, tokenizer, seeds=None) -> list[Trajectory]:
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sampling = SamplingParams(temperature=1.0, max_new_tokens=5, stop_token_ids=(stop,))
    ctx = RolloutContext(generator, tokenizer, sampling)
    return asyncio.run(run_rollouts(ctx, three_turns, ROWS, max_in_flight=len(ROWS), seeds=seeds))


def assert_trained_logprobs_match_a_forward_pass(model_dir: Path, trajectories: list[Trajectory],
                                                 models_by_version: dict | None = None) -> None:
    """Every sampled token's logprob is a forward pass over the trajectory's tokens: of the checkpoint, or (partial
    rollouts) of `models_by_version[v]`, the weights of the token's version v."""
    models = models_by_version or {None: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()}
    for trajectory in trajectories:
        (segment,) = trajectory.segments  # turns cut at the token limit are closed by the footer: no drift
        # each turn samples 1-5 tokens (5 unless the random model sampled the stop token first)
        assert trajectory.stats.turns == TURNS and TURNS <= segment.sampled_tokens <= 5 * TURNS
        ids = torch.tensor(segment.token_ids)
        mask = torch.tensor(segment.loss_mask[1:], dtype=torch.bool)
        versions = torch.tensor(segment.sampled_versions or [-1] * segment.sampled_tokens)
        for version, model in models.items():
            with torch.no_grad():
                logprobs = torch.log_softmax(model(ids[None]).logits[0, :-1].float(), dim=-1)  # [T-1, V]
            drawn = versions == version if version is not None else torch.ones_like(versions, dtype=torch.bool)
            reference = logprobs.gather(1, ids[1:, None])[:, 0][mask][drawn]
            torch.testing.assert_close(torch.tensor(segment.logprobs[1:])[mask][drawn], reference, atol=2e-5, rtol=0)


class BatchRecordingEngine(LocalEngine):
    """LocalEngine that remembers the batch size of each generate call."""

    batches: list[int] = []

    def generate(self, prompts, sampling, **kwargs):
        self.batches.append(len(prompts))
        return super().generate(prompts, sampling, **kwargs)


def test_local_engine_batches_concurrent_turns_and_its_logprobs_are_the_trainers(model_dir, tokenizer):
    engine = BatchRecordingEngine(model_dir)
    generator = EngineGenerator(engine, workers=1)
    try:
        trajectories = play(generator, tokenizer)
    finally:
        generator.close()
    assert sum(engine.batches) == len(ROWS) * TURNS and max(engine.batches) == len(ROWS)
    assert_trained_logprobs_match_a_forward_pass(model_dir, trajectories)


def test_seeded_turns_go_as_one_batch_and_sample_what_one_call_per_turn_does(model_dir, tokenizer):
    """Turns seeded each (a seed per trajectory, as the trainer rolls out) go to the in-process engine as one batch
    with a seed per prompt, and give the tokens and (to the fp32 floor) the logprobs of one engine call per turn."""
    runs = {}
    for max_batch in (256, 1):
        engine = BatchRecordingEngine(model_dir)
        engine.batches = []
        generator = EngineGenerator(engine, max_batch=max_batch)
        try:
            runs[max_batch] = engine.batches, play(generator, tokenizer, seeds=[7, 8, 9, 10])
        finally:
            generator.close()
    (batches, batched), (calls, alone) = runs[256], runs[1]
    assert max(batches) == len(ROWS) and sum(batches) == len(ROWS) * TURNS and calls == [1] * (len(ROWS) * TURNS)
    for one, other in zip(batched, alone, strict=True):
        (segment,), (reference,) = one.segments, other.segments
        assert (segment.token_ids, segment.loss_mask) == (reference.token_ids, reference.loss_mask)
        torch.testing.assert_close(segment.logprobs, reference.logprobs, atol=1e-6, rtol=0)
    assert len({tuple(t.segments[0].token_ids[-5:]) for t in batched}) == len(ROWS)  # each its own draws
    assert_trained_logprobs_match_a_forward_pass(model_dir, batched)


def turn_versions(segment) -> list[list[int]]:
    """The weight versions of each turn's sampled tokens (the runs of loss mask 1), in order."""
    turns, versions = [], iter(segment.sampled_versions)
    for before, sampled in zip([0, *segment.loss_mask], segment.loss_mask):
        if sampled and not before:
            turns.append([])
        if sampled:
            turns[-1].append(next(versions))
    return turns


def test_a_weight_push_mid_turn_continues_the_turn_under_the_new_weights(model_dir, tokenizer):
    """Partial rollouts: the engine a `PausableEngine`, the trajectories' second turns interrupted by a weight push
    (pause, new weights, resume as version 1) after their first decode step. The turns go on under the new weights:
    every sampled token carries the version that drew it, in order, the interrupted turn both, and its logprob is a
    forward pass of that version's weights over the trajectory's tokens."""
    engine = LocalEngine(model_dir)
    old = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for parameter in new.parameters():
            parameter.mul_(1.05)
    pausable = PausableEngine(engine)
    forwards = itertools.count()

    def push() -> None:
        pausable.pause()
        engine.update_weights(list(new.state_dict().items()))
        pausable.resume(1)

    def push_in_the_second_turn(module, args) -> None:
        if next(forwards) == 6:  # turn 1: the prefill and 4 decode steps; then turn 2's prefill and a decode step
            engine.interrupt()  # this call stops after the step; the push's pause keeps it from going on until resumed
            threading.Thread(target=push).start()

    engine.model.register_forward_pre_hook(push_in_the_second_turn)
    generator = EngineGenerator(pausable)
    try:
        trajectories = play(generator, tokenizer)
    finally:
        generator.close()
    assert pausable.version == 1
    for trajectory in trajectories:
        first, second, third = turn_versions(trajectory.segments[0])
        assert set(first) == {0} and second == sorted(second) and set(second) == {0, 1} and set(third) == {1}
    assert_trained_logprobs_match_a_forward_pass(model_dir, trajectories, {0: old, 1: new})


def test_sglang_client_on_a_serve_local_process(model_dir, tokenizer, tmp_path):
    port = free_port()
    armor = Path(sys.executable).parent / "armor"
    with (tmp_path / "server.log").open("w") as log:
        server = subprocess.Popen([str(armor), "serve-local", "--model", str(model_dir), "--port", str(port)],
                                  stdout=log, stderr=subprocess.STDOUT)
    try:
        engine = SGLangEngine([f"http://127.0.0.1:{port}"], SGLangEngineConfig(startup_timeout_s=120,
                                                                              poll_interval_s=0.2))
        generator = EngineGenerator(engine, workers=len(ROWS), max_batch=1)
        try:
            trajectories = play(generator, tokenizer)
        finally:
            generator.close()
            engine.close()
    finally:
        server.kill()
        server.wait(timeout=30)
    assert_trained_logprobs_match_a_forward_pass(model_dir, trajectories)


def test_an_engine_error_fails_the_trajectories_of_its_batch_and_the_run_goes_on(tiny_model_factory, tokenizer,
                                                                                  caplog):
    """A checkpoint whose vocabulary (128) is smaller than the tokenizer's (320): the engine raises on the batch;
    every trajectory in it ends failed with the engine's error, logged with its row."""
    generator = EngineGenerator(LocalEngine(tiny_model_factory("qwen2")), workers=1)
    try:
        trajectories = play(generator, tokenizer)
    finally:
        generator.close()
    assert {t.status for t in trajectories} == {Status.FAILED} and all(t.segments == [] for t in trajectories)
    assert all("IndexError" in t.error for t in trajectories)
    assert sorted(r.getMessage().split(": IndexError")[0] for r in caplog.records) == sorted(
        f"agentic: trajectory failed on row {row!r}" for row in ROWS)


def test_an_interrupted_engine_aborts_the_trajectories(model_dir, tokenizer):
    """After `interrupt` the in-process engine returns every generation partial ("abort"): the trajectories end
    aborted, keeping what was sampled."""
    from megatron_armor.agentic.driver import environment_rollout
    from megatron_armor.agentic.environment import EnvReply, Environment

    class Chat(Environment):
        def reset(self, row):
            return [{"role": "user", "content": row["prompt"]}]

        def step(self, messages):
            return EnvReply([{"role": "user", "content": "Go on."}])

        def score(self, messages):
            return 0.0

    engine = LocalEngine(model_dir)
    engine.interrupt()
    generator = EngineGenerator(engine)
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ctx = RolloutContext(generator, tokenizer, SamplingParams(max_new_tokens=5, stop_token_ids=(stop,)))
    try:
        trajectories = asyncio.run(run_rollouts(ctx, environment_rollout(Chat), ROWS))
    finally:
        generator.close()
    assert {(t.status, t.error, t.stats.turns) for t in trajectories} == {
        (Status.ABORTED, "the engine interrupted the turn", 1)}
