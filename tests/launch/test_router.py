"""SGLang's real router (sglang-router) in front of two CPU stand-in servers (`armor serve-local`) on loopback."""

import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_armor.config import ConfigError, load_config
from megatron_armor.launch.server_process import RolloutServer, ServerConfig
from megatron_armor.rollout import sglang_protocol as proto
from megatron_armor.rollout.base import SamplingParams
from megatron_armor.rollout.local import LocalEngine
from megatron_armor.rollout.router import RouterError, RouterConfig, SGLangRouter, use_sglang_router
from megatron_armor.rollout.sglang_engine import RolloutError, SGLangEngine, SGLangEngineConfig, http_call

DEMO = Path(__file__).parents[2] / "examples" / "tiny" / "armor.yaml"
SGLANG = ["rollout.backend=sglang", "rollout.sglang.urls=http://a:1", "rollout.sglang.ref_urls=http://b:1"]
FAST = SGLangEngineConfig(prompts_per_request=2, max_in_flight_per_server=2, backoff_s=0.05, startup_timeout_s=90,
                          poll_interval_s=0.1)
ROUND_ROBIN = RouterConfig(policy="round_robin", worker_timeout_s=60)
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12], [13, 14, 15], [16]]
LONG = SamplingParams(temperature=0.0, max_new_tokens=16)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    """Same shapes as `model_dir`, other weights (seed 1)."""
    from megatron_armor.models.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen2-seed1"), arch="qwen2", seed=1)


@pytest.fixture(scope="module")
def local_engine(model_dir):
    return LocalEngine(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    """Two stand-in servers started in parallel by the launcher's own `RolloutServer` (one thread each)."""
    spec = ServerConfig(model_path=str(model_dir), kind="local", startup_timeout_s=120, poll_interval_s=0.1)
    log_dir = str(tmp_path_factory.mktemp("router-test-servers"))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        started = [RolloutServer(spec, i, host="127.0.0.1", log_dir=log_dir) for i in range(2)]
    try:
        for server in started:
            server.wait_healthy()
        yield started
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def router(servers, tmp_path_factory):
    with SGLangRouter([s.url for s in servers], ROUND_ROBIN, log_dir=str(tmp_path_factory.mktemp("router-log"))) as r:
        yield r


def load(url: str, key: str = "num_running_reqs") -> int:
    return http_call(url, "/v1/loads", method="GET")["loads"][0][key]


def same_generation(got, want) -> bool:
    """Same prompt, tokens and finish reason; logprobs within 1e-5."""
    if (got.prompt_ids, got.response_ids, got.finish_reason) != (want.prompt_ids, want.response_ids, want.finish_reason):
        return False
    return torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)


def assert_same_generations(got, want):
    assert len(got) == len(want)
    differ = [i for i, (g, w) in enumerate(zip(got, want)) if not same_generation(g, w)]
    assert not differ, f"generations {differ} differ from the reference: {[got[i] for i in differ]}"


def test_generation_through_router_matches_local_engine(router, servers, local_engine):
    engine = SGLangEngine([s.url for s in servers], FAST, router_url=router.url)
    assert sorted(router.workers()) == sorted(s.url for s in servers)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=5, seed=123)
    assert_same_generations(engine.generate(PROMPTS, sampled), [  # per-prompt seed: seed + prompt index
        local_engine.generate([p], replace(sampled, seed=123 + i))[0] for i, p in enumerate(PROMPTS)
    ])
    assert engine.stats.retries == 0 and engine.stats.requests == len(PROMPTS)  # one prompt per routed request


def test_requests_spread_over_registered_workers_and_weights_reach_every_server(
    router, servers, model_dir, other_model_dir, local_engine
):
    """Server 0 is given other weights, so every generation tells which server produced it."""
    urls = [s.url for s in servers]
    engine = SGLangEngine(urls, FAST, router_url=router.url)
    SGLangEngine(urls[:1], FAST).update_weights_from_disk(str(other_model_dir))
    prompts = [[i + 1, i + 2] for i in range(8)]
    other = LocalEngine(AutoModelForCausalLM.from_pretrained(other_model_dir, dtype=torch.float32).eval())
    want = {urls[0]: other.generate(prompts, LONG), urls[1]: local_engine.generate(prompts, LONG)}

    def served_by() -> list[str]:
        out = engine.generate(prompts, LONG)
        return [next(url for url in urls if same_generation(g, want[url][i])) for i, g in enumerate(out)]

    assert set(served_by()) == set(urls)  # round_robin spreads the 8 requests over both servers
    first_id = router.workers()[urls[0]]
    router.remove_worker(urls[0])
    assert list(router.workers()) == [urls[1]]
    assert served_by() == [urls[1]] * len(prompts)  # nothing reaches a deregistered worker
    router.add_workers(urls[:1])
    assert sorted(router.workers()) == sorted(urls) and router.workers()[urls[0]] != first_id
    router.add_workers(urls)  # registering a listed worker again keeps it
    assert sorted(router.workers()) == sorted(urls)
    assert set(served_by()) == set(urls)
    engine.update_weights_from_disk(str(model_dir))  # the routed engine updates every server directly
    assert served_by() == [urls[1]] * len(prompts)  # ... so both serve model_dir's weights again


def test_worker_killed_mid_batch_loses_nothing(router, servers, local_engine):
    victim, survivor = servers
    engine = SGLangEngine([victim.url, survivor.url], FAST, router_url=router.url)
    prompts = [[i + 1, i + 2] for i in range(8)]
    http_call(victim.url, "/pause_generation", proto.pause_generation_request("in_place"))  # its requests wait
    with ThreadPoolExecutor(1) as pool:
        batch = pool.submit(engine.generate, prompts, LONG)
        deadline = time.monotonic() + 30
        while load(victim.url, "num_waiting_reqs") == 0:
            assert time.monotonic() < deadline, "the router sent the victim no request"
            time.sleep(0.005)
        assert not batch.done()  # the victim holds part of it
        os.kill(victim.pid(), signal.SIGKILL)
        out = batch.result(timeout=90)
    assert_same_generations(out, local_engine.generate(prompts, LONG))
    assert engine.health()  # the survivor still answers
    assert victim.ensure_alive()  # restarted on its port; the router (health checks off) still lists it
    assert_same_generations(engine.generate(prompts[:2], LONG), local_engine.generate(prompts[:2], LONG))


def test_dead_router_is_a_clear_error(servers, tmp_path):
    router = SGLangRouter([servers[1].url], ROUND_ROBIN, log_dir=str(tmp_path))
    engine = SGLangEngine([servers[1].url], replace(FAST, max_retries=1), router_url=router.url)
    os.kill(router.pid(), signal.SIGKILL)
    exited = rf"(?s)SGLang router {router.url} exited with code -9.*sglang-router-{router.port}\.log"
    with pytest.raises(RouterError, match=exited):
        for _ in range(1000):  # the process takes a moment to end
            router.check_alive()
            time.sleep(0.01)
    with pytest.raises(RouterError, match=exited):
        router.add_workers([servers[0].url])
    with pytest.raises(RolloutError, match=rf"failed after 1 retries: {router.url}/generate: ConnectionRefusedError"):
        engine.generate(PROMPTS[:1], LONG)
    router.stop()


def test_router_mode_detection(monkeypatch):
    assert [use_sglang_router(mode, 2) for mode in ("auto", "sglang", "none")] == [True, True, False]
    assert [use_sglang_router(mode, 1) for mode in ("auto", "sglang", "none")] == [False, True, False]
    monkeypatch.setitem(sys.modules, "sglang_router", None)  # what Python does for a package that is not there
    assert [use_sglang_router(mode, 2) for mode in ("auto", "none")] == [False, False]
    with pytest.raises(RouterError,
                       match=r"rollout.sglang.router is 'sglang' but .* pip install sglang-router==0\.3\.2"):
        use_sglang_router("sglang", 2)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.sglang.router_policy=least_loaded"], "rollout.sglang.router_policy: 'least_loaded' is not allowed"),
        (["rollout.sglang.router_url=http://r:1"], "rollout.sglang.router_url / ref_router_url apply to "
                                                    "rollout.backend sglang only"),
        (SGLANG + ["rollout.sglang.router=none", "rollout.sglang.router_url=http://r:1"],
         "rollout.sglang.router is none but rollout.sglang.router_url is set"),
        (SGLANG[:2] + ["rollout.anchors.engine=shared", "rollout.sglang.ref_router_url=http://r:2"],
         "rollout.sglang.ref_router_url \\(http://r:2\\) needs rollout.sglang.ref_urls"),
    ],
)
def test_router_config_is_validated(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DEMO, overrides)
