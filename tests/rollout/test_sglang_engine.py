"""SGLangEngine against real `http_server` subprocesses on loopback (the CPU stand-in for SGLang)."""

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_armor.rollout import sglang_protocol as proto
from megatron_armor.rollout.base import SamplingParams
from megatron_armor.rollout.local import LocalEngine
from megatron_armor.rollout.sglang_engine import RolloutError, SGLangEngine, SGLangEngineConfig, ServerError, http_call
from megatron_armor.utils.net import free_port

FAST = SGLangEngineConfig(prompts_per_request=2, max_in_flight_per_server=2, backoff_s=0.05, startup_timeout_s=90,
                          poll_interval_s=0.1, flush_attempts=1200, flush_interval_s=0.05)
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12], [13, 14, 15], [16]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


def load(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="module")
def servers(start_server, model_dir):
    """Three servers starting in parallel: two behind `engine`, the third for the kill test."""
    return [start_server(model_dir) for _ in range(3)]


@pytest.fixture(scope="module")
def engine(servers):
    return SGLangEngine([s.url for s in servers[:2]], FAST)


@torch.no_grad()
def hf_logprobs(model, prompt, response, temperature):
    """Independent reference: log_softmax(logits / T) of `response` after `prompt`, one unpadded forward."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [R, V]
    logprobs = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logprobs.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def assert_same_generations(got, want):
    assert [(g.prompt_ids, g.response_ids, g.finish_reason) for g in got] == [
        (w.prompt_ids, w.response_ids, w.finish_reason) for w in want
    ]
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)


def test_generate_matches_local_engine_and_hf_reference(engine, model_dir):
    model = load(model_dir)
    local = LocalEngine(model)
    stop = tuple(local.generate(PROMPTS[:2], GREEDY)[0].response_ids[2:3])  # some prompt stops early
    greedy = replace(GREEDY, stop_token_ids=stop)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=5, seed=123)
    for sampling in (greedy, sampled):
        got = engine.generate(PROMPTS, sampling)
        # Per-prompt seeds are seed + prompt index, so one-prompt local calls reproduce them exactly.
        want = local.generate(PROMPTS, sampling) if sampling.seed is None else [
            local.generate([p], replace(sampling, seed=sampling.seed + i))[0] for i, p in enumerate(PROMPTS)
        ]
        assert_same_generations(got, want)
        for g in got:
            reference = hf_logprobs(model, g.prompt_ids, g.response_ids, sampling.temperature)
            torch.testing.assert_close(torch.tensor(g.logprobs), reference, atol=1e-5, rtol=0)
    assert "stop" in {g.finish_reason for g in engine.generate(PROMPTS, greedy)}
    assert engine.stats.retries == 0 and engine.stats.requests >= 2 * 4
    assert engine.health()


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_update_weights_from_tensor_then_from_disk(engine, model_dir, second_tiny_model, load_format):
    other = load(second_tiny_model)
    pusher = SGLangEngine(engine.urls, replace(FAST, load_format=load_format, bucket_bytes=64 << 10))
    named = list(other.named_parameters())
    assert len(proto.bucket_named_tensors(named, pusher.config.bucket_bytes)) > 1  # several requests
    pusher.update_weights(named)
    assert_same_generations(engine.generate(PROMPTS, GREEDY), LocalEngine(other).generate(PROMPTS, GREEDY))
    name = "model.layers.1.mlp.down_proj.weight"
    for url in engine.urls:
        got = http_call(url, "/get_weights_by_name", {"name": name, "truncate_size": 3})
        torch.testing.assert_close(torch.tensor(got), other.get_parameter(name)[:3].detach())

    engine.update_weights_from_disk(str(model_dir))
    engine.flush_cache()
    assert_same_generations(engine.generate(PROMPTS, GREEDY), LocalEngine(load(model_dir)).generate(PROMPTS, GREEDY))


def test_bad_weight_update_names_server_and_parameter(engine):
    with pytest.raises(RolloutError, match=r"failed on 2/2 servers: http://127\.0\.0\.1:\d+.*no parameter 'nope'"):
        engine.update_weights([("nope", torch.zeros(2))])


def test_flush_cache_waits_for_requests_in_flight(engine, wait_for_load):
    long = SamplingParams(temperature=1.0, max_new_tokens=100, seed=0)
    busy = SGLangEngine(engine.urls[:1], replace(FAST, prompts_per_request=8))
    url = engine.urls[0]
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(busy.generate, [[1, 2]] * 8, long)
        wait_for_load(url, "num_running_reqs")
        with pytest.raises(ServerError, match="HTTP 400"):
            http_call(url, "/flush_cache")
        engine.flush_cache()  # re-asks until the generation above is done
        assert running.done() or http_call(url, "/v1/loads", method="GET")["loads"][0]["num_running_reqs"] == 0
        assert len(running.result(timeout=60)) == 8


def test_killed_server_mid_batch_loses_nothing(servers, model_dir, wait_for_load):
    victim, survivor = servers[2], servers[0]
    engine = SGLangEngine([victim.url, survivor.url], FAST)
    prompts = [[i + 1, i + 2] for i in range(20)]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=40)
    with ThreadPoolExecutor(1) as pool:
        batch = pool.submit(engine.generate, prompts, sampling)
        wait_for_load(victim.url, "num_running_reqs")
        os.kill(victim.proc.pid, signal.SIGKILL)
        out = batch.result(timeout=60)
    assert_same_generations(out, LocalEngine(load(model_dir)).generate(prompts, sampling))
    assert engine.stats.retries >= 1 and engine.stats.failed_requests >= 1
    assert engine.stats.as_metrics()["rollout/retries"] == engine.stats.retries
    assert engine.health()  # the survivor still serves


def test_server_that_never_comes_up_times_out_clearly():
    url = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"SGLang server {url} was not healthy within 1 s .*ConnectionRefusedError"):
        SGLangEngine([url], replace(FAST, startup_timeout_s=1.0))
    assert time.monotonic() - start < 5
