"""The CPU SGLang stand-in, in-process: readiness, /generate shapes, aborts, pauses and busy refusals."""

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from megatron_armor.rollout import sglang_protocol as proto
from megatron_armor.rollout.http_server import _MappedPayloads
from megatron_armor.rollout.sglang_engine import SGLangEngine, SGLangEngineConfig, ServerError, http_call
from megatron_armor.rollout.tensor_serialization import share_storages


@pytest.fixture(scope="module")
def server(tiny_model_factory, serving):
    with serving(tiny_model_factory("qwen2")) as srv:
        yield srv


@pytest.fixture(scope="module")
def ready_url(server):
    return f"http://127.0.0.1:{server.state.port}"


def test_503_until_the_model_is_loaded(tiny_model_factory, serving):
    with serving(tiny_model_factory("qwen2"), load=False) as server:
        url = f"http://127.0.0.1:{server.state.port}"
        for path in ("/health_generate", "/generate", "/model_info"):
            with pytest.raises(ServerError, match="HTTP 503"):
                http_call(url, path, method="GET", timeout=5)
        server.state.load()
        assert http_call(url, "/health_generate", method="GET") is None
        assert http_call(url, "/model_info", method="GET")["architectures"] == ["Qwen2ForCausalLM"]
        info = http_call(url, "/get_server_info", method="GET")
        assert (info["tp_size"], info["dp_size"]) == (1, 1) and "version" in info


def test_generate_single_batch_and_n(server, ready_url, teacher_logprobs):
    params = {"temperature": 0.7, "max_new_tokens": 3, "sampling_seed": 1}
    single = http_call(ready_url, "/generate", {"input_ids": [1, 2, 3], "sampling_params": params})
    assert isinstance(single, dict) and len(single["output_ids"]) == 3
    logprobs, tokens, texts = zip(*single["meta_info"]["output_token_logprobs"])
    assert list(tokens) == single["output_ids"] and set(texts) == {None}
    want = teacher_logprobs(server.state.model_path, [1, 2, 3], single["output_ids"], 0.7)
    torch.testing.assert_close(torch.tensor(logprobs), want, atol=1e-5, rtol=0)
    assert single["meta_info"]["finish_reason"] == {"type": "length", "length": 3}

    many = http_call(ready_url, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {**params, "n": 3}, "rid": "q"})
    assert [item["meta_info"]["id"] for item in many] == ["q-0", "q-1", "q-2"]
    assert len({tuple(item["output_ids"]) for item in many}) > 1  # n samples of one prompt differ

    batch = http_call(ready_url, "/generate", {"input_ids": [[1, 2], [3]], "sampling_params": {**params, "n": 2},
                                               "rid": ["a", "b"]})
    assert [item["meta_info"]["id"] for item in batch] == ["a-0", "a-1", "b-0", "b-1"]
    assert [item["meta_info"]["prompt_tokens"] for item in batch] == [2, 2, 1, 1]


def test_stop_token_and_no_stop_trim(ready_url):
    greedy = {"temperature": 0.0, "max_new_tokens": 8}
    first = http_call(ready_url, "/generate", {"input_ids": [5, 6], "sampling_params": greedy})["output_ids"][0]
    stop = {**greedy, "stop_token_ids": [first]}
    trimmed = http_call(ready_url, "/generate", {"input_ids": [5, 6], "sampling_params": stop})
    kept = http_call(ready_url, "/generate", {"input_ids": [5, 6], "sampling_params": {**stop, "no_stop_trim": True}})
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    assert trimmed["output_ids"] == [] and kept["output_ids"] == [first]
    assert [t[1] for t in trimmed["meta_info"]["output_token_logprobs"]] == [first]


def test_aborts_match_rids_as_sglang_and_busy_server_refuses_flush(server, ready_url, wait_for_load):
    body = {"input_ids": [[1], [2], [3]], "sampling_params": {"max_new_tokens": 4}, "rid": ["job-1", "job-10", "job-2"]}
    with ThreadPoolExecutor(1) as pool, server.state.engine_lock:  # hold the engine: the request waits in the queue
        queued = pool.submit(http_call, ready_url, "/generate", body)
        wait_for_load(ready_url, "num_waiting_reqs")
        with pytest.raises(ServerError, match="HTTP 400.*pending requests"):
            http_call(ready_url, "/flush_cache")
        with pytest.raises(ServerError, match="HTTP 400.*idle"):
            http_call(ready_url, "/release_memory_occupation", {"tags": None})
        for rid in ("job", "job-3"):  # no item has this rid: ignored, like SGLang's tokenizer manager
            assert http_call(ready_url, "/abort_request", proto.abort_request(rid)) is None
        http_call(ready_url, "/abort_request", proto.abort_request("job-1"))  # and the prefix match of its scheduler
    reply = queued.result(timeout=30)
    assert [item["meta_info"]["finish_reason"]["type"] for item in reply] == ["abort", "abort", "length"]
    assert [len(item["output_ids"]) for item in reply] == [0, 0, 4]
    assert "Cache flushed" in http_call(ready_url, "/flush_cache")
    assert http_call(ready_url, "/release_memory_occupation", {"tags": ["kv_cache"]}) is None
    assert http_call(ready_url, "/resume_memory_occupation", {"tags": ["kv_cache"]}) is None


def test_released_memory_refuses_generation_and_weight_loads_until_resumed(server, ready_url):
    name = "model.norm.weight"
    weights = [(name, torch.full_like(server.state.engine.named_parameters_hf()[name], 0.5))]
    generate = {"input_ids": [5, 6], "sampling_params": {"temperature": 0.0, "max_new_tokens": 2}}
    params = {n: t.clone() for n, t in server.state.engine.named_parameters_hf().items()}
    info = http_call(ready_url, "/server_info", method="GET")
    releases, resident = info["memory_releases"], info["weight_bytes_resident"]
    assert resident == sum(p.nbytes for p in server.state.engine.model.parameters())
    http_call(ready_url, "/release_memory_occupation", {"tags": ["weights"]})
    assert http_call(ready_url, "/server_info", method="GET")["weight_bytes_resident"] == 0  # freed in place
    with pytest.raises(ServerError, match=r"HTTP 400.*\['weights'\] is released"):
        http_call(ready_url, "/generate", generate)
    with pytest.raises(ServerError, match=r"HTTP 400.*/get_weights_by_name.*\['weights'\] is released"):
        http_call(ready_url, "/get_weights_by_name", {"name": name})
    with pytest.raises(ServerError, match="HTTP 400.*weight update"):
        http_call(ready_url, "/update_weights_from_tensor", _tensor_update(weights)[1])
    with pytest.raises(ServerError, match=r"HTTP 400.*\['weights'\] already released"):
        http_call(ready_url, "/release_memory_occupation", {"tags": None})
    http_call(ready_url, "/release_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})  # the rest too
    http_call(ready_url, "/resume_memory_occupation", {"tags": ["weights", "cuda_graph"]})
    with pytest.raises(ServerError, match=r"HTTP 400.*\['cuda_graph', 'weights'\] not released"):
        http_call(ready_url, "/resume_memory_occupation", {"tags": None})
    with pytest.raises(ServerError, match=r"\['kv_cache'\] is released"):
        http_call(ready_url, "/generate", generate)
    http_call(ready_url, "/health_generate", method="GET")  # alive while released
    http_call(ready_url, "/resume_memory_occupation", {"tags": ["kv_cache"]})
    info = http_call(ready_url, "/server_info", method="GET")
    assert info["released_memory_tags"] == [] and info["memory_releases"] == releases + 2
    assert info["weight_bytes_resident"] == resident
    # Without --enable-weights-cpu-backup the release lost the weights' values (SGLang's memory saver):
    # no generation until every one of them is loaded again.
    assert info["stale_weight_tensors"] == len(params) and not info["enable_weights_cpu_backup"]
    http_call(ready_url, "/update_weights_from_tensor", _tensor_update(list(params.items())[:-1])[1])
    with pytest.raises(ServerError, match=r"HTTP 400.*1 weights \(e\.g\. .*\) lost their values"):
        http_call(ready_url, "/generate", generate)
    http_call(ready_url, "/update_weights_from_tensor", _tensor_update(list(params.items())[-1:])[1])
    assert len(http_call(ready_url, "/generate", generate)["output_ids"]) == 2
    assert all(torch.equal(t, params[n]) for n, t in server.state.engine.named_parameters_hf().items())
    with pytest.raises(ServerError, match="HTTP 400.*subset"):
        http_call(ready_url, "/release_memory_occupation", {"tags": ["gpu"]})


def test_weights_with_a_cpu_backup_survive_a_release(tiny_model_factory, serving):
    """--enable-weights-cpu-backup: generation right after resume, as before the release; the client sees it."""
    with serving(tiny_model_factory("qwen2")) as server:
        server.state.weights_cpu_backup = True
        url = f"http://127.0.0.1:{server.state.port}"
        generate = {"input_ids": [5, 6], "sampling_params": {"temperature": 0.0, "max_new_tokens": 3}}
        before = http_call(url, "/generate", generate)["output_ids"]
        weights = {name: t.clone() for name, t in server.state.engine.named_parameters_hf().items()}
        http_call(url, "/release_memory_occupation", {"tags": None})
        assert http_call(url, "/server_info", method="GET")["weight_bytes_resident"] == 0  # freed, values kept on the host
        http_call(url, "/resume_memory_occupation", {"tags": None})
        restored = server.state.engine.named_parameters_hf()
        assert all(torch.equal(restored[name], weights[name]) for name in weights)
        assert http_call(url, "/generate", generate)["output_ids"] == before
        engine = SGLangEngine([url], SGLangEngineConfig(startup_timeout_s=30))
        assert engine.keeps_weights_across_release()
        server.state.weights_cpu_backup = False
        assert not engine.keeps_weights_across_release()


def _tensor_update(named, load_format="flattened_bucket", **options):
    payload = proto.tensor_payload(named, load_format)
    return payload, proto.update_weights_from_tensor_request(payload, load_format=load_format, **options)


def test_weight_update_formats_and_bad_payloads(server, ready_url, os_system_payload):
    name = "model.norm.weight"
    before = server.state.engine.named_parameters_hf()[name].clone()
    for load_format in (None, "flattened_bucket"):
        new = torch.full_like(before, 0.5 if load_format else 0.25)
        payload, body = _tensor_update([(name, new)], load_format)
        assert http_call(ready_url, "/update_weights_from_tensor", body)["success"] is True
        assert http_call(ready_url, "/get_weights_by_name", {"name": name}) == new.tolist()
    payload, bad_shape = _tensor_update([(name, torch.zeros(3))])
    with pytest.raises(ServerError, match="HTTP 400.*model.norm.weight has shape"):
        http_call(ready_url, "/update_weights_from_tensor", bad_shape)
    with pytest.raises(ServerError, match="HTTP 400.*bad payload.*could not be unpickled"):
        http_call(ready_url, "/update_weights_from_tensor", {"serialized_named_tensors": ["bm90IGEgdGVuc29y"]})
    hostile, marker = os_system_payload
    with pytest.raises(ServerError, match="HTTP 400.*bad payload.*refers to posix.system"):
        http_call(ready_url, "/update_weights_from_tensor", {"serialized_named_tensors": [hostile]})
    assert not marker.exists()
    payload, restore = _tensor_update([(name, before)], weight_version="v2")
    http_call(ready_url, "/update_weights_from_tensor", restore)
    assert http_call(ready_url, "/model_info", method="GET")["weight_version"] == "v2"
    assert http_call(ready_url, "/update_weight_version", {"new_version": "v3"})["success"]
    assert http_call(ready_url, "/model_info", method="GET")["weight_version"] == "v3"


def test_refusals_name_the_problem(ready_url):
    with pytest.raises(ServerError, match="HTTP 404.*no endpoint /nope"):
        http_call(ready_url, "/nope")
    with pytest.raises(ServerError, match="HTTP 400.*input_ids only"):
        http_call(ready_url, "/generate", {"text": "hi"})
    with pytest.raises(ServerError, match="HTTP 400.*top_k"):
        http_call(ready_url, "/generate", {"input_ids": [1], "sampling_params": {"top_k": 5}})


def test_out_of_vocabulary_ids_are_a_400_naming_them(server, ready_url):
    vocab = server.state.vocab_size
    for prompts, outside in (([1, vocab], [vocab]), ([[1], [-1, 2, vocab + 7]], [-1, vocab + 7])):
        with pytest.raises(ServerError, match="HTTP 400: .*" + re.escape(f"input_ids {outside} are outside the vocabulary [0, {vocab})")):
            http_call(ready_url, "/generate", {"input_ids": prompts})
    assert http_call(ready_url, "/generate", {"input_ids": [vocab - 1], "sampling_params": {"max_new_tokens": 1}})


def _until(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


def test_pause_wakes_when_a_request_is_held_after_the_last_one_left(server, ready_url, monkeypatch):
    """The abort-mode pause waits until only held requests remain. Here "late" is counted as waiting
    but reaches its hold only after "first" (aborted by the pause) has left, so the pause can only
    learn of it from the hold itself. The held request also does not count against /flush_cache."""
    state = server.state
    first_gone = threading.Event()
    wait_while_paused = state._wait_while_paused

    def late_hold(epoch, items):
        if items[0].rid == "late":
            first_gone.wait(timeout=30)
        wait_while_paused(epoch, items)

    monkeypatch.setattr(state, "_wait_while_paused", late_hold)

    def generate(rid):
        return state.generate({"input_ids": [1], "sampling_params": {"max_new_tokens": 2}, "rid": rid})

    with ThreadPoolExecutor(3) as pool:
        try:
            with state.engine_lock:
                first = pool.submit(generate, "first")
                _until(lambda: state.waiting == 1)
                pause = pool.submit(state.pause_generation, {"mode": "abort"})
                _until(lambda: state.paused)
                late = pool.submit(generate, "late")
                _until(lambda: state.waiting == 2)
            assert first.result(timeout=30)["meta_info"]["finish_reason"]["type"] == "abort"
            first_gone.set()
            assert pause.result(timeout=10)["status"] == "ok"
            assert not late.done() and "Cache flushed" in http_call(ready_url, "/flush_cache")
        finally:
            first_gone.set()
            state.continue_generation({})
        assert late.result(timeout=30)["meta_info"]["finish_reason"] == {"type": "length", "length": 2}


def test_a_cpu_server_keeps_recent_shared_storages_mapped_within_twice_its_weights():
    """Reused handles resolve from torch's cache while mapped; the oldest go beyond 2 x the model's bytes,
    never those of the payload just loaded; private copies (misaligned flattened entries) and everything on a
    GPU server are not kept."""
    model = torch.nn.Linear(16, 16, bias=False)  # 1 KiB of weights: a 2 KiB budget
    state = SimpleNamespace(device=torch.device("cpu"), engine=SimpleNamespace(model=model))
    mapped = _MappedPayloads(state)

    def shared(nbytes):
        tensor = torch.zeros(nbytes // 4)
        share_storages([tensor])
        return tensor

    a, b, c, big = shared(1024), shared(512), shared(1024), shared(4096)
    mapped.loaded([("a", a), ("b", b[:64]), ("private", torch.zeros(8))])
    assert set(mapped.storages) == {a.data_ptr(), b.data_ptr()}
    mapped.loaded([("c", c)])  # 2.5 KiB held: a, the oldest, goes
    assert list(mapped.storages) == [b.data_ptr(), c.data_ptr()]
    mapped.loaded([("b", b)])  # reused: the most recent again
    assert list(mapped.storages) == [c.data_ptr(), b.data_ptr()]
    mapped.loaded([("big", big)])  # over the budget alone: kept, everything older goes
    assert list(mapped.storages) == [big.data_ptr()]
    on_gpu = _MappedPayloads(SimpleNamespace(device=torch.device("cuda"), engine=state.engine))
    on_gpu.loaded([("a", a)])
    assert not on_gpu.storages


def test_routed_experts_in_sglang_schema_equal_the_local_engine_s(tiny_model_factory, serving, ready_url):
    """--enable-return-routed-experts on a MoE model: a request's `return_routed_experts` gets meta_info.routed_experts,
    base64 int32 [prompt + completion - 1, layers, top-k] (SGLang's), the routes the in-process engine records for the
    same draw; the SGLang client reads them into its generations. A server without the flag refuses the request."""
    import base64

    import numpy as np

    from megatron_armor.rollout.base import SamplingParams
    from megatron_armor.rollout.local import LocalEngine

    model = tiny_model_factory("qwen3_moe")
    prompts = [[5, 17, 30], [40, 8, 9, 10]]
    engine, sampling = LocalEngine(model, record_routes=True), SamplingParams(temperature=1.0, max_new_tokens=4, seed=11)
    local, alone = engine.generate(prompts, sampling), engine.generate(prompts[:1], sampling)  # as the client sends it
    with serving(model, load=False) as moe:
        moe.state.return_routed_experts = True
        moe.state.load()
        url = f"http://127.0.0.1:{moe.state.port}"
        reply = http_call(url, "/generate", {"input_ids": prompts, "return_routed_experts": True, "sampling_params": {
            "temperature": 1.0, "max_new_tokens": 4, "sampling_seed": 11, "ignore_eos": True}})
        client = SGLangEngine([url], SGLangEngineConfig(startup_timeout_s=30, routed_experts_shape=(2, 2)))
        through_client = client.generate(prompts[:1], sampling)
    for item, generation in zip(reply, local):
        assert item["output_ids"] == generation.response_ids
        routes = np.frombuffer(base64.b64decode(item["meta_info"]["routed_experts"]), dtype=np.int32).reshape(-1, 2, 2)
        assert routes.shape[0] == item["meta_info"]["prompt_tokens"] + item["meta_info"]["completion_tokens"] - 1
        assert torch.equal(torch.from_numpy(routes.copy()), generation.routed_experts)
    assert through_client[0].response_ids == alone[0].response_ids
    assert torch.equal(through_client[0].routed_experts, alone[0].routed_experts)
    with pytest.raises(ServerError, match="--enable-return-routed-experts"):
        http_call(ready_url, "/generate", {"input_ids": [1, 2], "return_routed_experts": True})
