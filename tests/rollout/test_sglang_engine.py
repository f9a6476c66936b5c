"""SGLangEngine against real `http_server` subprocesses on loopback (the CPU stand-in for SGLang)."""

import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_armor.config import WeightSyncConfig
from megatron_armor.rollout import sglang_protocol as proto
from megatron_armor.rollout.base import SamplingParams
from megatron_armor.rollout.local import LocalEngine
from megatron_armor.rollout.local_server import RequestError
from megatron_armor.rollout.sglang_engine import (
    RolloutError, SGLangEngine, SGLangEngineConfig, ServerError, _Dispatcher, _Server, http_call,
)
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


@pytest.fixture(scope="module")
def inproc(serving, model_dir):
    """An in-process server: a test can hold its engine lock, or pause it, directly."""
    with serving(model_dir) as server:
        yield server


def stub(serving, **routes):
    """A server that passes the engine's readiness checks and answers only `routes` besides: every other
    call fails with HTTP 404."""
    return serving(routes={"/health_generate": lambda _: None, "/server_info": lambda _: {"tp_size": 1}, **routes})


def assert_same_generations(got, want):
    assert [(g.prompt_ids, g.response_ids, g.finish_reason) for g in got] == [
        (w.prompt_ids, w.response_ids, w.finish_reason) for w in want
    ]
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)


def test_generate_matches_local_engine_and_hf_reference(engine, model_dir, teacher_logprobs):
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
            reference = teacher_logprobs(model_dir, g.prompt_ids, g.response_ids, sampling.temperature)
            torch.testing.assert_close(torch.tensor(g.logprobs), reference, atol=1e-5, rtol=0)
    assert "stop" in {g.finish_reason for g in engine.generate(PROMPTS, greedy)}
    assert engine.stats.retries == 0 and engine.stats.requests >= 2 * 4
    assert engine.health()


@pytest.mark.parametrize("payload", ["per_tensor", "flattened_bucket"])
def test_update_weights_from_tensor_then_from_disk(engine, model_dir, second_tiny_model, payload):
    other = load(second_tiny_model)
    pushes = WeightSyncConfig(method="tensor", payload=payload, bucket_mb=64 / 1024)  # 64 KiB buckets
    pusher = SGLangEngine(engine.urls, replace(FAST, weight_sync=pushes))
    named = list(other.named_parameters())
    assert len(list(proto.bucket_named_tensors(named, pusher.config.weight_sync.bucket_bytes))) > 1  # several requests
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


def test_flush_cache_waits_for_requests_in_flight(inproc, wait_for_load):
    url = f"http://127.0.0.1:{inproc.state.port}"
    engine = SGLangEngine([url], FAST)
    busy = SGLangEngine([url], replace(FAST, prompts_per_request=8))
    with ThreadPoolExecutor(2) as pool:
        with inproc.state.engine_lock:  # the request cannot run, let alone finish, until this block ends
            queued = pool.submit(busy.generate, [[1, 2]] * 8, SamplingParams(max_new_tokens=4))
            wait_for_load(url, "num_waiting_reqs")
            with pytest.raises(ServerError, match="HTTP 400"):
                http_call(url, "/flush_cache")
            flushed = pool.submit(engine.flush_cache)  # re-asks until the generation is done
            time.sleep(0.2)
            assert not flushed.done()
        flushed.result(timeout=60)
        assert queued.done() or http_call(url, "/v1/loads", method="GET")["loads"][0]["num_waiting_reqs"] == 0
        assert len(queued.result(timeout=60)) == 8


def test_failed_push_leaves_every_server_generating(servers, serving):
    """The pause fails on one server (and so does the continue there): the others are still told to continue."""
    url = servers[1].url
    with stub(serving) as broken:
        engine = SGLangEngine([url, f"http://127.0.0.1:{broken.state.port}"], FAST)  # waits until both are up
        version = http_call(url, "/model_info", method="GET")["weight_version"]
        try:
            with pytest.raises(RolloutError, match=r"/pause_generation failed on 1/2 servers.*HTTP 404") as failed:
                engine.update_weights([("model.norm.weight", torch.ones(1))])
            reply = http_call(url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}, timeout=30)
            assert reply["meta_info"]["finish_reason"] == {"type": "length", "length": 2}  # not held by a pause
            assert any("/continue_generation failed on 1/2 servers" in note for note in failed.value.__notes__)
            assert http_call(url, "/model_info", method="GET")["weight_version"] == version
        finally:
            http_call(url, "/continue_generation", proto.continue_generation_request())


def test_first_fatal_error_aborts_requests_in_flight_and_returns(inproc, serving):
    """Two requests wait on the paused in-process server when the stub rejects the other two: generate
    raises at once, having aborted the waiting ones by their item rids, and retries nothing."""
    url = f"http://127.0.0.1:{inproc.state.port}"
    reject = threading.Event()

    def rejecting(_):
        reject.wait(timeout=30)
        raise RequestError("/generate: rejected by the stub")

    pool = ThreadPoolExecutor(1)
    inproc.state.pause_generation({"mode": "in_place"})  # requests wait until /continue_generation
    try:
        with stub(serving, **{"/generate": rejecting}) as rejector:
            engine = SGLangEngine([url, f"http://127.0.0.1:{rejector.state.port}"], replace(FAST, max_in_flight_per_server=4))
            call = pool.submit(engine.generate, [[1, 2]] * 8, SamplingParams(max_new_tokens=4))
            deadline = time.monotonic() + 30
            while inproc.state.waiting < 2:  # both of its requests are held by the pause
                assert time.monotonic() < deadline and not call.done()
                time.sleep(0.005)
            reject.set()
            with pytest.raises(RolloutError, match=r"rejected /generate.*rejected by the stub.*\(0/8 prompts finished\)"):
                call.result(timeout=30)
        deadline = time.monotonic() + 30
        while inproc.state.waiting:  # the held requests return aborted
            assert time.monotonic() < deadline, "the waiting requests were not aborted"
            time.sleep(0.005)
        assert engine.stats.retries == 0
    finally:
        reject.set()
        inproc.state.continue_generation({})
        pool.shutdown()


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
    # A bound socket that never listens holds the port (no other test's server can take it) and refuses connections.
    with socket.socket() as reserved:
        reserved.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{reserved.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(TimeoutError,
                           match=rf"SGLang server {url} was not healthy within 1 s .*ConnectionRefusedError"):
            SGLangEngine([url], replace(FAST, startup_timeout_s=1.0))
    assert time.monotonic() - start < 30


def test_tensor_weight_sync_refuses_servers_on_other_hosts():
    """Their handles into this host's shared memory or GPUs would fail at the first push; refused at start-up."""
    local = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match=r"weight_sync tensor .* but http://203\.0\.113\.7:30000 is not on this host: "
                                         r"use rollout\.weight_sync\.method distributed"):
        SGLangEngine([local, "http://203.0.113.7:30000"], replace(FAST, weight_sync=WeightSyncConfig(method="tensor")))


def test_a_push_leaves_out_a_dead_server_which_joins_a_later_push_once_it_is_back(serving, model_dir,
                                                                                 second_tiny_model):
    """A dead push server is skipped (`missed_push`) and retired from generation; restarted with the checkpoint's
    weights on its address, it joins the next push (the transport reset for it) and serves the pushed weights."""
    pushed = list(load(second_tiny_model).named_parameters())
    want = LocalEngine(load(second_tiny_model)).generate(PROMPTS, GREEDY)
    port = free_port()
    with serving(model_dir) as keeper:
        with serving(model_dir, port=port):
            engine = SGLangEngine([f"http://127.0.0.1:{keeper.state.port}", f"http://127.0.0.1:{port}"], FAST)
            engine.update_weights(pushed)
            assert engine.missed_push() == set()
        dead = f"http://127.0.0.1:{port}"
        engine.update_weights(pushed)  # the second server is gone
        assert engine.missed_push() == {dead}
        engine.retire_servers(engine.missed_push())
        assert_same_generations(engine.generate(PROMPTS, GREEDY), want)
        assert engine.stats.failed_requests == 0  # nothing was sent to the retired server
        with serving(model_dir, port=port):  # back, with the checkpoint's weights
            engine.update_weights(pushed)
            assert engine.missed_push() == set()
            engine.retire_servers(set())
            versions = {http_call(url, "/model_info", method="GET")["weight_version"] for url in engine.urls}
            assert versions == {"3"}  # the third push reached both
            assert_same_generations(engine.generate(PROMPTS * 2, GREEDY), want * 2)  # both serve the pushed weights


def test_dispatcher_breaks_ties_round_robin_from_its_first_server():
    """Equally loaded servers take turns from `first` (the rank): clients sending one request at a time each spread
    them over every server, and two clients starting at different ranks pick different servers; a less loaded
    server still wins over the turn, and a retired one is never chosen."""
    def picks(dispatcher, n, *, release=True):
        urls = []
        for _ in range(n):
            server = dispatcher.acquire()
            urls.append(server.url)
            if release:
                dispatcher.release(server, failed=False)
        return urls

    urls = ["a", "b", "c"]
    assert picks(_Dispatcher([_Server(u) for u in urls], 1.0, first=1), 4) == ["b", "c", "a", "b"]
    assert [picks(_Dispatcher([_Server(u) for u in urls], 1.0, first=rank), 1) for rank in range(4)] == [
        ["a"], ["b"], ["c"], ["a"]]
    busy = _Dispatcher([_Server(u) for u in urls], 1.0, first=0)
    assert picks(busy, 5, release=False) == ["a", "b", "c", "a", "b"]  # least loaded first, turns among equals
    busy.retired.add("c")
    assert picks(busy, 1, release=False) == ["a"]  # c has fewer in flight but missed a push
