"""Partial rollouts (rollout/pausable.py): a weight push interrupts generations in flight, which continue under the new
weights; every token keeps the logprob and the weight version it was sampled with.

The engine's model is held at a chosen decode step (a forward pre-hook waits), so the pause lands after exactly
`STEPS_BEFORE_PAUSE` tokens, through the in-process engine and through a real HTTP server (SGLang's schema, the
client's /abort_request) alike; each token's recorded logprob is then checked against an unpadded HF forward of the
model version that drew it."""

import threading
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_armor.rollout.base import Generation, SamplingParams
from megatron_armor.rollout.local import LocalEngine
from megatron_armor.rollout.pausable import PausableEngine, _extended
from megatron_armor.rollout.sglang_engine import SGLangEngine, SGLangEngineConfig

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=12, seed=7)  # no stop token: every row runs to the limit
STEPS_BEFORE_PAUSE = 4  # the pause lands while the model computes the 5th token (each row keeps 5)
CLIENT = SGLangEngineConfig(prompts_per_request=len(PROMPTS), startup_timeout_s=60, poll_interval_s=0.1)


def load(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


class HeldForward:
    """A forward pre-hook on `model` that, at forward call `at` (1-based: the prefill is call 1), signals `reached`
    and waits for `release`."""

    def __init__(self, model: torch.nn.Module, at: int) -> None:
        self.calls, self.at = 0, at
        self.reached, self.release = threading.Event(), threading.Event()
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module, args) -> None:
        self.calls += 1
        if self.calls == self.at:
            self.reached.set()
            assert self.release.wait(60), "the test never released the held forward"


def generate_across_a_push(pausable: PausableEngine, model: torch.nn.Module, new_weights, aborted=lambda: True,
                           sampling: SamplingParams = SAMPLING):
    """Start `pausable.generate`, pause it with the model held at forward STEPS_BEFORE_PAUSE + 1 (the engine must
    decode the prompts in one batch), push `new_weights` as version 1, resume; the generations."""
    held = HeldForward(model, STEPS_BEFORE_PAUSE + 1)
    result: list = []
    worker = threading.Thread(target=lambda: result.extend(pausable.generate(PROMPTS, sampling)))
    worker.start()
    assert held.reached.wait(60)
    pausing = threading.Thread(target=pausable.pause)
    pausing.start()
    deadline = threading.Event()
    while not aborted():  # the interrupt must reach the engine before the held step ends
        deadline.wait(0.005)
    held.release.set()
    pausing.join(60)
    assert not pausing.is_alive()
    held.handle.remove()
    served = pausable.engine.generate(PROMPTS[:1], replace(SAMPLING, max_new_tokens=3))  # e.g. validation, paused
    assert len(served[0].response_ids) == 3 and served[0].finish_reason == "length"
    pausable.update_weights(new_weights)
    pausable.resume(1)
    worker.join(60)
    assert not worker.is_alive()
    return result


def assert_tokens_keep_their_versions(generations, models, teacher_logprobs):
    """Every row: 5 tokens of version 0, the rest of version 1, 12 in all; each token's logprob is the one its
    version's model gives it (an unpadded HF forward over the prompt and the whole response)."""
    first = STEPS_BEFORE_PAUSE + 1
    for prompt, generation in zip(PROMPTS, generations, strict=True):
        assert generation.prompt_ids == prompt and generation.finish_reason == "length"
        assert generation.versions == [0] * first + [1] * (SAMPLING.max_new_tokens - first)
        assert len(generation.response_ids) == len(generation.logprobs) == SAMPLING.max_new_tokens
        recorded = torch.tensor(generation.logprobs)
        for version, model_dir in enumerate(models):
            want = teacher_logprobs(model_dir, prompt, generation.response_ids, SAMPLING.temperature)
            mine = torch.tensor(generation.versions) == version
            torch.testing.assert_close(recorded[mine], want[mine], atol=1e-5, rtol=0)
            assert (recorded[~mine] - want[~mine]).abs().max() > 1e-3  # the other version gives other logprobs


def test_without_a_pause_the_engine_s_own_generations_come_back(tiny_model_factory):
    engine = LocalEngine(load(tiny_model_factory("qwen2")))
    got = PausableEngine(engine, version=3).generate(PROMPTS, SAMPLING)
    want = engine.generate(PROMPTS, SAMPLING)
    assert [(g.response_ids, g.logprobs, g.finish_reason) for g in got] == [
        (w.response_ids, w.logprobs, w.finish_reason) for w in want]
    assert all(g.versions == [3] * len(g.response_ids) for g in got)


def test_a_continued_local_generation_keeps_each_token_s_version_and_logprob(
    tiny_model_factory, second_tiny_model, teacher_logprobs,
):
    model_dir = tiny_model_factory("qwen2")
    engine = LocalEngine(load(model_dir))
    pausable = PausableEngine(engine)
    generations = generate_across_a_push(pausable, engine.model, list(load(second_tiny_model).named_parameters()))
    assert_tokens_keep_their_versions(generations, (model_dir, second_tiny_model), teacher_logprobs)
    # an interrupted generation comes back partial from the engine itself
    engine.interrupt()
    partial = engine.generate(PROMPTS, SAMPLING)
    engine.end_interrupt()
    assert [(g.response_ids, g.finish_reason) for g in partial] == [([], "abort")] * len(PROMPTS)


def test_a_continued_server_generation_keeps_each_token_s_version_and_logprob(
    serving, tiny_model_factory, second_tiny_model, teacher_logprobs,
):
    """Through a real HTTP server: the client aborts its own requests by rid; the server answers each with the tokens
    it drew (SGLang's abort), and the continuation is sent after the push."""
    model_dir = tiny_model_factory("qwen2")
    with serving(model_dir) as server:
        state = server.state
        client = SGLangEngine([f"http://127.0.0.1:{state.port}"], CLIENT)
        pausable = PausableEngine(client)
        generations = generate_across_a_push(
            pausable, state.engine.model, list(load(second_tiny_model).named_parameters()),
            aborted=lambda: len(state._aborted) == len(PROMPTS),
            sampling=replace(SAMPLING, seed=None))  # per-prompt seeds would make one engine call per prompt
        assert_tokens_keep_their_versions(generations, (model_dir, second_tiny_model), teacher_logprobs)
        assert client.stats.retries == 0  # continued, not re-sent from scratch
        # a pause with nothing in flight returns at once, and generation goes on with the weights it finds
        pausable.pause()
        pausable.resume(2)
        again = pausable.generate(PROMPTS[:1], replace(SAMPLING, max_new_tokens=3))
        assert again[0].versions == [2, 2, 2]


def test_a_continuation_keeps_what_the_row_s_own_budget_allows_and_finishes_a_raced_stop():
    """All continuations of a round share one call, to the largest budget left: a row with fewer tokens left keeps
    only those (finish length); an interrupted row whose last token is a stop token, or that is full, is finished."""
    sampling = SamplingParams(max_new_tokens=6, stop_token_ids=(0,))
    head = Generation([9], [4, 5, 6, 7], [-1.0] * 4, "abort", versions=[0] * 4)  # 2 tokens left
    longer = Generation([9, 4, 5, 6, 7], [8, 8, 8], [-2.0] * 3, "length")  # the round's call ran to 3
    assert _extended(head, longer, 1, sampling) == Generation([9], [4, 5, 6, 7, 8, 8], [-1.0] * 4 + [-2.0] * 2,
                                                              "length", versions=[0] * 4 + [1] * 2)
    stopped = _extended(head, Generation([9, 4, 5, 6, 7], [3, 0], [-2.0] * 2, "stop"), 1, sampling)
    assert stopped.finish_reason == "stop" and stopped.versions == [0] * 4 + [1] * 2
    raced = _extended(Generation([9], [], [], "abort", versions=[]), Generation([9], [3, 0], [-1.0] * 2, "abort"), 0,
                      sampling)
    assert raced.finish_reason == "stop"
    full = _extended(Generation([9], [], [], "abort", versions=[]), Generation([9], [1] * 6, [-1.0] * 6, "abort"), 0,
                     sampling)
    assert full.finish_reason == "length"
    again = _extended(head, Generation([9, 4, 5, 6, 7], [3], [-2.0], "abort"), 2, sampling)
    assert again.finish_reason == "abort" and again.versions == [0] * 4 + [2]  # interrupted again: continues later
