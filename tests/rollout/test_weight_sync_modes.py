"""Weight sync into a real `armor serve-local` process in every mode, pause/continue, and group errors."""

import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from megatron_armor.config import WeightSyncConfig
from megatron_armor.rollout import sglang_protocol as proto
from megatron_armor.rollout import tensor_serialization
from megatron_armor.rollout.base import SamplingParams
from megatron_armor.rollout.sglang_engine import SGLangEngine, SGLangEngineConfig, ServerError, http_call
from megatron_armor.rollout.weight_group import WORLD_SIZE_KEY
from megatron_armor.rollout.weight_sync import sync_weights
from megatron_armor.rollout.weight_transport import TensorTransport
from megatron_armor.utils.net import free_port

FAST = SGLangEngineConfig(startup_timeout_s=90, poll_interval_s=0.1, weight_group_timeout_s=60,
                          weight_sync=WeightSyncConfig(bucket_mb=64 / 1024))
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=5)
# Every weight_sync method with each payload it takes (disk writes safetensors: no payload).
SYNC_MODES = [("tensor", "flattened_bucket"), ("tensor", "per_tensor"), ("distributed", "flattened_bucket"),
              ("distributed", "per_tensor"), ("disk", "flattened_bucket")]


def pushing(method: str = "tensor", payload: str = "flattened_bucket", directory: str | None = None, *,
            bucket_kib: int = 64, **knobs) -> SGLangEngineConfig:
    """FAST pushing as a rollout.weight_sync section of `method`, `payload`, `directory` and `bucket_kib` KiB buckets
    says (with other client `knobs`)."""
    weight_sync = WeightSyncConfig(method=method, dir=directory, payload=payload, bucket_mb=bucket_kib / 1024)
    return replace(FAST, weight_sync=weight_sync, **knobs)


def load(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def reference_logprobs(model, prompt, response):
    """The trainer-side model's log_softmax of `response` after `prompt` (T = 1), one unpadded forward."""
    logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="module")
def engine(start_server, model_dir):
    """A client of one serve-local process; its construction waits until the server is healthy."""
    return SGLangEngine([start_server(model_dir).url], FAST)


@pytest.fixture(scope="module")
def url(engine):
    return engine.urls[0]


@pytest.mark.parametrize("method, payload", SYNC_MODES)
def test_every_mode_makes_server_logprobs_equal_the_trainers(
    engine, model_dir, second_tiny_model, tmp_path, method, payload
):
    trained, original = load(second_tiny_model), load(model_dir)
    engine.update_weights_from_disk(str(model_dir))  # start from the original weights
    pusher = SGLangEngine(engine.urls, pushing(method, payload, str(tmp_path / "weights")))
    pusher.update_weights(list(trained.named_parameters()))
    pusher.close()
    for g in engine.generate(PROMPTS, GREEDY):
        want = reference_logprobs(trained, g.prompt_ids, g.response_ids)
        torch.testing.assert_close(torch.tensor(g.logprobs), want, atol=1e-5, rtol=0)
        before = reference_logprobs(original, g.prompt_ids, g.response_ids)
        assert (want - before).abs().max() > 1e-2  # the push changed what the server computes
    assert http_call(engine.urls[0], "/model_info", method="GET")["weight_version"] == "1"


class LiveTensors:
    """Yields fresh copies of tensors and records the peak bytes of those yielded and still alive."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref] = []
        self.peak = 0

    def alive(self) -> int:
        return sum(t.nbytes for t in (r() for r in self.refs) if t is not None)

    def stream(self, named):
        for name, tensor in named:
            copy = tensor.detach().clone()
            self.refs.append(weakref.ref(copy))
            self.peak = max(self.peak, self.alive())
            yield name, copy


@pytest.mark.parametrize("method, payload", SYNC_MODES)
def test_every_mode_streams_a_generator_holding_about_two_buckets(
    engine, model_dir, second_tiny_model, tmp_path, method, payload
):
    """The push draws the generator as buckets go out (here 40 KiB, below the MLP weights' 44 KiB, so those go
    alone and the staging buffers grow): at most two buckets and one tensor ahead are alive at once."""
    trained = dict(load(second_tiny_model).named_parameters())
    engine.update_weights_from_disk(str(model_dir))
    config = pushing(method, payload, str(tmp_path / "weights"), bucket_kib=40)
    pusher, live = SGLangEngine(engine.urls, config), LiveTensors()
    report = sync_weights(pusher, live.stream(trained.items()))
    pusher.close()
    sizes = [t.nbytes for t in trained.values()]
    assert (report.tensors, report.bytes) == (len(sizes), sum(sizes))
    largest = max(sizes)
    assert live.peak <= 2 * max(config.weight_sync.bucket_bytes, largest) + largest < sum(sizes) / 3
    assert live.alive() == 0  # nothing yielded is kept after the push
    for name, want in trained.items():
        got = http_call(engine.urls[0], "/get_weights_by_name", {"name": name, "truncate_size": want.shape[0]})
        torch.testing.assert_close(torch.tensor(got), want.detach(), atol=0, rtol=0)


def test_tensor_staging_grows_to_the_budget_only_as_buckets_need():
    server, sent = SimpleNamespace(url="stub", tp_size=1), []
    transport = TensorTransport([server], lambda path, body_for: sent.append(body_for(server)),
                                WeightSyncConfig(bucket_mb=64 / 2**20, payload="flattened_bucket"))

    def named():  # buckets of 64, 160 (one tensor over the budget) and 32 bytes
        return iter([("a", torch.zeros(8)), ("b", torch.zeros(8)), ("c", torch.zeros(40)), ("d", torch.zeros(8))])

    transport.push(named(), "1")
    staging = dict(transport._staging)
    assert {slot: buffer.numel() for slot, buffer in staging.items()} == {0: 64, 1: 160}
    transport.push(named(), "2")
    assert all(transport._staging[slot] is buffer for slot, buffer in staging.items())  # kept between pushes
    assert [(b["flush_cache"], b.get("weight_version")) for b in sent] == [
        (False, None), (False, None), (True, "1"), (False, None), (False, None), (True, "2")
    ]
    transport.release_buffers()  # an offloaded trainer's rollout phase: the buffers go, the next push makes them again
    assert transport._staging == {}
    transport.push(named(), "3")
    assert {slot: buffer.numel() for slot, buffer in transport._staging.items()} == {0: 64, 1: 160}
    transport.close()
    small = TensorTransport([server], lambda path, body_for: None,
                            WeightSyncConfig(bucket_mb=1, payload="flattened_bucket"))
    small.push(iter([("a", torch.zeros(16))]), "1")  # a 64-byte model under a 1 MiB budget
    assert {slot: buffer.numel() for slot, buffer in small._staging.items()} == {0: 128}
    small.close()


def test_per_tensor_push_of_shared_weights_stages_nothing(engine, model_dir, second_tiny_model):
    """Weights the trainer keeps in shared memory reach the server from their own storage: no staging buffer
    is made, the server copies them (a later change on the trainer's side does not reach it), and pushes
    that reuse those storages keep working; a private tensor among them is staged alone."""
    trained = {name: p.detach().clone() for name, p in load(second_tiny_model).named_parameters()}
    tensor_serialization.share_storages(trained.values())
    engine.update_weights_from_disk(str(model_dir))
    pusher = SGLangEngine(engine.urls, pushing("tensor", "per_tensor"))
    name = "model.layers.1.mlp.down_proj.weight"

    def served() -> torch.Tensor:
        return torch.tensor(http_call(engine.urls[0], "/get_weights_by_name", {"name": name, "truncate_size": 4}))

    for version in range(2):
        pusher.update_weights(trained.items())
        assert pusher._transport._staging == {}
        torch.testing.assert_close(served(), trained[name][:4], atol=0, rtol=0)
        for g in engine.generate(PROMPTS, GREEDY):
            want = reference_logprobs(load_with(model_dir, trained), g.prompt_ids, g.response_ids)
            torch.testing.assert_close(torch.tensor(g.logprobs), want, atol=1e-5, rtol=0)
        pushed = trained[name].clone()
        trained[name].mul_(2)  # the trainer's next update, in place
        torch.testing.assert_close(served(), pushed[:4], atol=0, rtol=0)
    private = torch.full_like(trained["model.norm.weight"], 0.5)
    pusher.update_weights([*trained.items(), ("model.norm.weight", private)])
    assert [b.numel() for b in pusher._transport._staging.values()] == [2 * private.nbytes]
    got = http_call(engine.urls[0], "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 2})
    assert got == [0.5, 0.5]
    pusher.close()


def load_with(model_dir, weights):
    model = load(model_dir)
    model.load_state_dict(weights)
    return model


def test_disk_push_replaces_the_previous_push_directory(engine, model_dir, tmp_path):
    name = "model.norm.weight"
    size = load(model_dir).get_parameter(name).numel()
    pusher = SGLangEngine(engine.urls, pushing("disk", directory=str(tmp_path)))
    seen = set()
    for value in (0.5, 0.25):
        pusher.update_weights(iter([(name, torch.full((size,), value))]))
        (pushed,) = tmp_path.iterdir()  # the previous push's directory is gone
        assert pushed not in seen and [f.name for f in pushed.iterdir()] == ["model-00000.safetensors"]
        seen.add(pushed)
        assert http_call(engine.urls[0], "/get_weights_by_name", {"name": name}) == [value] * size
    pusher.close()
    assert list(tmp_path.iterdir()) == []


def test_distributed_group_errors_are_clear(url):
    name, port = "mismatch", free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    store.set(f"{name}/{WORLD_SIZE_KEY}", "2")
    spec = proto.WeightGroupSpec("127.0.0.1", port, rank_offset=1, world_size=3, group_name=name, backend="gloo")
    with pytest.raises(ServerError, match="HTTP 400.*says world_size 3, but the trainer .* created it for 2 ranks"):
        http_call(url, "/init_weights_update_group", spec.body())
    with pytest.raises(ServerError, match="HTTP 400.*backend 'nccl' needs a server on a GPU \\(--device cuda\\)"):
        http_call(url, "/init_weights_update_group", replace(spec, backend="nccl").body())
    update = proto.DistributedUpdate.of([("model.norm.weight", torch.zeros(4))], group_name="nope")
    with pytest.raises(ServerError, match="HTTP 400.*no weight update group 'nope' .*call /init_weights_update_group"):
        http_call(url, "/update_weights_from_distributed", update.body())
    with pytest.raises(ServerError, match="HTTP 400.*no weight update group 'nope'"):
        http_call(url, "/destroy_weights_update_group", proto.destroy_weights_update_group_request("nope"))


def test_pause_modes_and_continue(url, wait_for_load):
    long = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 400, "temperature": 1.0, "sampling_seed": 0}}
    short = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}}

    def finish(future):
        return future.result(timeout=60)["meta_info"]["finish_reason"]

    def pause(mode):
        assert http_call(url, "/pause_generation", proto.pause_generation_request(mode))["status"] == "ok"

    def submit_held(pool):
        """A request sent while paused: it waits (counted as waiting), neither run nor aborted."""
        future = pool.submit(http_call, url, "/generate", short)
        wait_for_load(url, "num_waiting_reqs")
        assert not future.done()
        return future

    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(http_call, url, "/generate", long)
        wait_for_load(url, "num_running_reqs")
        pause("abort")
        loads = http_call(url, "/v1/loads", method="GET")["loads"][0]
        assert (loads["num_running_reqs"], loads["num_waiting_reqs"]) == (0, 0)  # abort mode answers once idle
        assert finish(running)["type"] == "abort"
        held = submit_held(pool)
        assert http_call(url, "/continue_generation", proto.continue_generation_request())["status"] == "ok"
        assert finish(held) == {"type": "length", "length": 3}

        pause("retract")
        held = submit_held(pool)
        http_call(url, "/continue_generation", proto.continue_generation_request())
        assert finish(held) == {"type": "length", "length": 3}

        pause("in_place")
        held = submit_held(pool)
        pause("abort")  # aborts what an earlier pause held
        assert finish(held)["type"] == "abort"
        http_call(url, "/continue_generation", proto.continue_generation_request())
        assert finish(pool.submit(http_call, url, "/generate", short))["type"] == "length"


def test_distributed_push_after_a_server_restart_forms_a_new_group(model_dir, serving):
    """A restarted server (same address, checkpoint weights, no group) does not report the last pushed
    weight_version, so the next push leaves the old group and forms a new one instead of failing."""
    name, port = "model.norm.weight", free_port()
    shape = load(model_dir).get_parameter(name).shape
    url = f"http://127.0.0.1:{port}"
    with serving(model_dir, port) as first:
        engine = SGLangEngine([url], pushing("distributed", weight_group_timeout_s=30))
        engine.update_weights([(name, torch.full(shape, 0.5))])
        assert len(first.state._groups) == 1
    with serving(model_dir, port) as restarted:
        assert http_call(url, "/model_info", method="GET")["weight_version"] == "default"
        engine.update_weights([(name, torch.full(shape, 0.25))])
        assert http_call(url, "/get_weights_by_name", {"name": name}) == [0.25] * shape[0]
        assert http_call(url, "/model_info", method="GET")["weight_version"] == "2"
        engine.close()
        assert restarted.state._groups == {}
