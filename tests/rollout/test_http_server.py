"""The CPU SGLang stand-in, in-process: readiness, /generate shapes, aborts and busy refusals."""

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megatron_armor.rollout import sglang_protocol as proto
from megatron_armor.rollout.http_server import LocalSGLangServer
from megatron_armor.rollout.local_server import LocalServerState
from megatron_armor.rollout.sglang_engine import ServerError, http_call


@contextlib.contextmanager
def _serving(model_dir):
    """A bound server thread whose model is not loaded yet (call `state.load()`)."""
    srv = LocalSGLangServer(LocalServerState(model_dir, host="127.0.0.1", port=0))
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    with _serving(tiny_model_factory("qwen2")) as srv:
        srv.state.load()
        yield srv


@pytest.fixture(scope="module")
def ready_url(server):
    return f"http://127.0.0.1:{server.state.port}"


def test_503_until_the_model_is_loaded(tiny_model_factory):
    with _serving(tiny_model_factory("qwen2")) as server:
        url = f"http://127.0.0.1:{server.state.port}"
        for path in ("/health_generate", "/generate", "/model_info"):
            with pytest.raises(ServerError, match="HTTP 503"):
                http_call(url, path, method="GET", timeout=5)
        server.state.load()
        assert http_call(url, "/health_generate", method="GET") is None
        assert http_call(url, "/model_info", method="GET")["architectures"] == ["Qwen2ForCausalLM"]
        info = http_call(url, "/get_server_info", method="GET")
        assert (info["tp_size"], info["dp_size"]) == (1, 1) and "version" in info


def test_generate_single_batch_and_n(ready_url):
    params = {"temperature": 1.0, "max_new_tokens": 3, "sampling_seed": 1}
    single = http_call(ready_url, "/generate", {"input_ids": [1, 2, 3], "sampling_params": params})
    assert isinstance(single, dict) and len(single["output_ids"]) == 3
    lp, token, text = single["meta_info"]["output_token_logprobs"][0]
    assert isinstance(lp, float) and token == single["output_ids"][0] and text is None
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


def test_queued_request_is_aborted_and_busy_server_refuses_flush(server, ready_url, wait_for_load):
    body = {"input_ids": [[1], [2]], "sampling_params": {"max_new_tokens": 4}, "rid": ["job-0", "job-1"]}
    with ThreadPoolExecutor(1) as pool, server.state.engine_lock:  # hold the engine: the request waits in the queue
        queued = pool.submit(http_call, ready_url, "/generate", body)
        wait_for_load(ready_url, "num_waiting_reqs")
        with pytest.raises(ServerError, match="HTTP 400.*pending requests"):
            http_call(ready_url, "/flush_cache")
        with pytest.raises(ServerError, match="HTTP 400.*idle"):
            http_call(ready_url, "/release_memory_occupation", {"tags": None})
        assert http_call(ready_url, "/abort_request", proto.abort_request("job")) is None
    reply = queued.result(timeout=30)
    assert [item["meta_info"]["finish_reason"]["type"] for item in reply] == ["abort", "abort"]
    assert [item["output_ids"] for item in reply] == [[], []]
    assert "Cache flushed" in http_call(ready_url, "/flush_cache")
    assert http_call(ready_url, "/release_memory_occupation", {"tags": ["kv_cache"]}) is None
    assert http_call(ready_url, "/resume_memory_occupation", {"tags": None}) is None


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
    assert http_call(ready_url, "/update_weight_version", proto.update_weight_version_request("v3"))["success"]
    assert http_call(ready_url, "/model_info", method="GET")["weight_version"] == "v3"


def test_refusals_name_the_problem(ready_url):
    with pytest.raises(ServerError, match="HTTP 404.*no endpoint /nope"):
        http_call(ready_url, "/nope")
    with pytest.raises(ServerError, match="HTTP 400.*input_ids only"):
        http_call(ready_url, "/generate", {"text": "hi"})
    with pytest.raises(ServerError, match="HTTP 400.*top_k"):
        http_call(ready_url, "/generate", {"input_ids": [1], "sampling_params": {"top_k": 5}})
