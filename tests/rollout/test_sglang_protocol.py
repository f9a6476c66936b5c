"""SGLang request bodies and response parsing against payloads written from SGLang 0.5.15's schema."""

import pytest
import torch

from megatron_armor.rollout import sglang_protocol as proto
from megatron_armor.rollout import tensor_serialization
from megatron_armor.rollout.base import Generation, SamplingParams

# A batched /generate reply as SGLang's tokenizer manager returns it with --skip-tokenizer-init,
# return_logprob=true and no_stop_trim=true (spec §2): stop, length and abort items.
SGLANG_BATCH_REPLY = [
    {
        "output_ids": [791, 6864, 151643],
        "meta_info": {
            "id": "req7-0", "finish_reason": {"type": "stop", "matched": 151643}, "prompt_tokens": 3,
            "completion_tokens": 3, "cached_tokens": 0, "weight_version": "default", "num_retractions": 0,
            "e2e_latency": 0.051,
            "output_token_logprobs": [[-0.5, 791, None], [-1.25, 6864, None], [-0.015625, 151643, None]],
        },
    },
    {
        "output_ids": [11, 12],
        "meta_info": {
            "id": "req7-1", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 2,
            "completion_tokens": 2, "cached_tokens": 1, "weight_version": "default", "num_retractions": 0,
            "output_token_logprobs": [[-2.0, 11, None], [-3.5, 12, None]],
        },
    },
    {
        "output_ids": [],
        "meta_info": {
            "id": "req7-2",
            "finish_reason": {"type": "abort", "message": "Abort before prefill", "status_code": 400, "err_type": None},
            "prompt_tokens": 1, "completion_tokens": 0, "cached_tokens": 0, "weight_version": "default",
            "num_retractions": 0, "output_token_logprobs": [],
        },
    },
]
PROMPTS = [[1, 2, 3], [4, 5], [6]]


def test_generate_request_body_is_sglang_batch_schema():
    sampling = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=32, stop_token_ids=(0,), seed=100)
    body = proto.generate_request([[1, 2, 3], [4, 5]], sampling, indices=[4, 9], rid="abc")
    assert body == {
        "input_ids": [[1, 2, 3], [4, 5]],
        "sampling_params": [
            {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_new_tokens": 32, "stop_token_ids": [0],
             "ignore_eos": True, "no_stop_trim": True, "skip_special_tokens": False, "sampling_seed": 104},
            {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_new_tokens": 32, "stop_token_ids": [0],
             "ignore_eos": True, "no_stop_trim": True, "skip_special_tokens": False, "sampling_seed": 109},
        ],
        "return_logprob": True, "logprob_start_len": -1, "return_text_in_logprobs": False, "stream": False,
        "rid": ["abc-0", "abc-1"],
    }


def test_generate_request_with_per_prompt_seeds_sends_each_its_own():
    sampling = SamplingParams(max_new_tokens=4, seeds=(70, 71, 72))
    body = proto.generate_request([[4, 5], [6]], sampling, indices=[2, 0])
    assert [p["sampling_seed"] for p in body["sampling_params"]] == [72, 70]
    single = proto.single_generate_request([6], sampling, index=1, rid="r")
    assert single["sampling_params"]["sampling_seed"] == 71


def test_generate_request_without_seed_omits_sampling_seed():
    body = proto.generate_request([[1]], SamplingParams(temperature=0.0))
    assert "sampling_seed" not in body["sampling_params"][0] and "rid" not in body
    with pytest.raises(ValueError, match="2 indices for 1 prompts"):
        proto.generate_request([[1]], SamplingParams(), indices=[0, 1])


def test_parse_batch_reply_reads_logprob_triples_and_finish_types():
    out = proto.parse_generate_response(PROMPTS, SGLANG_BATCH_REPLY)
    assert out[0] == Generation([1, 2, 3], [791, 6864, 151643], [-0.5, -1.25, -0.015625], "stop")
    assert out[1] == Generation([4, 5], [11, 12], [-2.0, -3.5], "length")
    assert out[2] == proto.Aborted("Abort before prefill", Generation([6], [], [], "abort"))


def test_an_aborted_item_keeps_the_tokens_drawn_before_the_abort():
    """SGLang answers an aborted request with what it generated (slime's partial rollouts read it)."""
    item = {"output_ids": [5, 9], "meta_info": {"finish_reason": {"type": "abort", "message": "Abort request"},
                                                "output_token_logprobs": [[-0.1, 5, None], [-0.2, 9, None]]}}
    assert proto.parse_generate_item([1], item) == proto.Aborted("Abort request", Generation([1], [5, 9], [-0.1, -0.2],
                                                                                             "abort"))


def test_parse_uses_triples_when_output_ids_are_stop_trimmed():
    item = {"output_ids": [5], "meta_info": {"finish_reason": {"type": "stop", "matched": 0},
                                             "output_token_logprobs": [[-0.1, 5, None], [-0.2, 0, None]]}}
    assert proto.parse_generate_item([1], item).response_ids == [5, 0]


@pytest.mark.parametrize(
    "reply, match",
    [
        (SGLANG_BATCH_REPLY[:2], "returned a list of 2 items for a batch of 3"),
        ({"output_ids": []}, "returned dict items"),
    ],
)
def test_parse_rejects_wrong_item_count(reply, match):
    with pytest.raises(ValueError, match=match):
        proto.parse_generate_response(PROMPTS, reply)


def test_parse_rejects_unknown_finish_and_missing_logprobs():
    with pytest.raises(ValueError, match="stop, length or abort"):
        proto.parse_generate_item([1], {"meta_info": {"finish_reason": {"type": "eos"}}})
    with pytest.raises(ValueError, match="return_logprob=true"):
        proto.parse_generate_item([1], {"meta_info": {"finish_reason": {"type": "length", "length": 1}}})


def test_server_side_item_body_round_trips_through_the_parser():
    finish = proto.finish_reason_body("stop", stop_token=0)
    item = proto.generate_item_body("r-1", 2, [7, 0], [-1.5, -0.25], finish, "v3")
    assert item == {
        "output_ids": [7, 0],
        "meta_info": {"id": "r-1", "finish_reason": {"type": "stop", "matched": 0}, "prompt_tokens": 2,
                      "completion_tokens": 2, "cached_tokens": 0, "weight_version": "v3", "num_retractions": 0,
                      "output_token_logprobs": [[-1.5, 7, None], [-0.25, 0, None]]},
    }
    assert proto.parse_generate_item([1, 2], item) == Generation([1, 2], [7, 0], [-1.5, -0.25], "stop")
    assert proto.finish_reason_body("length", length=4) == {"type": "length", "length": 4}
    assert proto.finish_reason_body("abort", message="m")["type"] == "abort"


def test_sampling_from_body_defaults_greedy_and_refusals():
    parsed = proto.sampling_from_body({"temperature": 1e-8, "n": 3, "sampling_seed": 5})
    assert parsed == proto.RequestSampling(SamplingParams(temperature=0.0, max_new_tokens=128, seed=5), n=3)
    client = proto.sampling_params_body(SamplingParams(temperature=0.5, stop_token_ids=(2,), seed=1), seed=7)
    assert proto.sampling_from_body(client) == proto.RequestSampling(
        SamplingParams(0.5, 1.0, 64, (2,), 7), n=1, ignore_eos=True, no_stop_trim=True
    )
    with pytest.raises(ValueError, match="top_k"):
        proto.sampling_from_body({"top_k": 20})


# Request fields of SGLang 0.5.15's weight and control endpoints (io_struct.py; spec §3).
SGLANG_FIELDS = {
    "/update_weights_from_tensor": {"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests",
                                    "weight_version", "torch_empty_cache", "disable_draft_model"},
    "/update_weights_from_disk": {"model_path", "load_format", "abort_all_requests", "weight_version", "flush_cache",
                                  "torch_empty_cache", "keep_pause"},
    "/init_weights_update_group": {"master_address", "master_port", "rank_offset", "world_size", "group_name",
                                   "backend"},
    "/update_weights_from_distributed": {"names", "dtypes", "shapes", "group_name", "flush_cache",
                                         "abort_all_requests", "weight_version", "load_format"},
    "/destroy_weights_update_group": {"group_name"},
    "/pause_generation": {"mode"},
    "/continue_generation": {"torch_empty_cache"},
    "/update_weight_version": {"new_version", "abort_all_requests"},
}


def assert_sglang_body(path, body, required):
    assert set(body) <= SGLANG_FIELDS[path], f"{path}: fields SGLang does not know: {set(body) - SGLANG_FIELDS[path]}"
    assert required <= set(body), f"{path}: missing {required - set(body)}"


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_update_weights_from_tensor_body_one_entry_per_tp_rank(load_format):
    tensors = [("model.norm.weight", torch.randn(8)), ("lm_head.weight", torch.randn(4, 8, dtype=torch.bfloat16))]
    payload = proto.tensor_payload(tensors, load_format)
    body = proto.update_weights_from_tensor_request(payload, tp_size=2, load_format=load_format, flush_cache=False,
                                                    weight_version="7")
    assert_sglang_body("/update_weights_from_tensor", body, {"serialized_named_tensors", "load_format"})
    assert (body["load_format"], body["flush_cache"], body["weight_version"]) == (load_format, False, "7")
    entries = body["serialized_named_tensors"]
    assert len(entries) == 2 and all(isinstance(e, str) for e in entries)
    for rank in (0, 1):
        decoded = proto.named_tensors_from_request(body, tp_rank=rank)
        assert [n for n, _ in decoded] == [n for n, _ in tensors]
        assert all(got.dtype == want.dtype and torch.equal(got, want) for (_, got), (_, want) in zip(decoded, tensors))
    with pytest.raises(ValueError, match="TP rank 2"):
        proto.named_tensors_from_request(body, tp_rank=2)


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_tensor_payload_lives_in_the_staging_buffer(load_format):
    """Both formats send only the staging buffer's storage (the caller's tensors stay private)."""
    tensors = [("a", torch.randn(3, 5)), ("b", torch.arange(7, dtype=torch.int64))]
    staging = torch.zeros(1024, dtype=torch.uint8)
    payload = proto.tensor_payload(tensors, load_format, staging)
    sent = [payload["flattened_tensor"]] if load_format else [t for _, t in payload]
    assert {t.untyped_storage().data_ptr() for t in sent} == {staging.untyped_storage().data_ptr()}
    decoded = proto.named_tensors_from_request(proto.update_weights_from_tensor_request(payload, load_format=load_format))
    assert all(torch.equal(got, want) for (_, got), (_, want) in zip(decoded, tensors))
    assert not any(t.is_shared() for _, t in tensors)


def test_per_tensor_payload_sends_shared_tensors_as_they_are():
    """load_format null: a tensor in shared memory goes as a handle to its own storage, the rest is staged
    (payload_bytes counts only those); a flattened bucket stages every tensor."""
    shared, private = torch.randn(3, 5), torch.arange(7, dtype=torch.int64)
    tensor_serialization.share_storages([shared])
    tensors = [("shared", shared), ("private", private), ("transposed", shared.t())]
    assert proto.payload_bytes(tensors, None) == 64 + 60  # private at 0 (56 B), transposed at 64 (16-byte aligned)
    assert proto.payload_bytes(tensors, "flattened_bucket") == 60 + 56 + 60
    staging = tensor_serialization.shared_buffer(256)
    payload = proto.tensor_payload(tensors, None, staging)
    assert [n for n, _ in payload] == ["shared", "private", "transposed"]
    assert payload[0][1].data_ptr() == shared.data_ptr()
    assert {t.untyped_storage().data_ptr() for _, t in payload[1:]} == {staging.untyped_storage().data_ptr()}
    decoded = proto.named_tensors_from_request(proto.update_weights_from_tensor_request(payload, load_format=None))
    assert all(torch.equal(got, want) for (_, got), (_, want) in zip(decoded, tensors))
    assert not private.is_shared()
    assert proto.payload_bytes([("shared", shared)], None) == 0


def test_distributed_and_control_bodies_use_sglang_fields():
    spec = proto.WeightGroupSpec("10.0.0.1", 29500, rank_offset=3, world_size=5, group_name="g", backend="gloo")
    assert spec.body() == {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 3, "world_size": 5,
                           "group_name": "g", "backend": "gloo"}
    assert_sglang_body("/init_weights_update_group", spec.body(), set(SGLANG_FIELDS["/init_weights_update_group"]))
    assert proto.WeightGroupSpec.from_body(spec.body()) == spec
    with pytest.raises(ValueError, match="rank_offset 5 must be in"):
        proto.WeightGroupSpec.from_body({**spec.body(), "rank_offset": 5})

    tensors = [("a", torch.zeros(2, 3, dtype=torch.bfloat16)), ("b", torch.zeros(4))]
    update = proto.DistributedUpdate.of(tensors, group_name="g", load_format="flattened_bucket", weight_version="2")
    assert update.body() == {"names": ["a", "b"], "dtypes": ["bfloat16", "float32"], "shapes": [[2, 3], [4]],
                             "group_name": "g", "flush_cache": True, "load_format": "flattened_bucket",
                             "weight_version": "2"}
    assert_sglang_body("/update_weights_from_distributed", update.body(), {"names", "dtypes", "shapes", "group_name"})
    assert proto.DistributedUpdate.from_body(update.body()) == update
    with pytest.raises(ValueError, match="b has unknown dtype 'float99'"):
        proto.DistributedUpdate.from_body({**update.body(), "dtypes": ["bfloat16", "float99"]})

    bodies = {
        "/destroy_weights_update_group": proto.destroy_weights_update_group_request("g"),
        "/pause_generation": proto.pause_generation_request("retract"),
        "/continue_generation": proto.continue_generation_request(),
        "/update_weights_from_disk": proto.update_weights_from_disk_request("/ckpt", weight_version="3"),
    }
    for path, body in bodies.items():
        assert_sglang_body(path, body, set())
    assert bodies["/pause_generation"] == {"mode": "retract"}
    with pytest.raises(ValueError, match="abort, retract or in_place"):
        proto.pause_generation_request("stop")


def test_bucketing_respects_byte_budget_and_order():
    tensors = [(f"w{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 5])]  # float32: 40, 40, 120, 20, 20 bytes
    buckets = list(proto.bucket_named_tensors(tensors, bucket_bytes=80))
    assert [([name for name, _ in b], last) for b, last in buckets] == [
        (["w0", "w1"], False), (["w2"], False), (["w3", "w4"], True)
    ]
    assert list(proto.bucket_named_tensors([], 80)) == []
    odd = [("b", torch.zeros(3, dtype=torch.uint8)), ("f", torch.zeros(4))]  # 16-byte aligned: f at 16, ends at 32
    assert [len(b) for b, _ in proto.bucket_named_tensors(odd, 24, align=16)] == [1, 1]
    assert [len(b) for b, _ in proto.bucket_named_tensors(odd, 24)] == [2]


def test_bucketing_draws_lazily_one_tensor_ahead():
    drawn = []

    def source():
        for i in range(5):
            drawn.append(i)
            yield f"w{i}", torch.zeros(10)  # 40 bytes: two per 80-byte bucket

    buckets = proto.bucket_named_tensors(source(), bucket_bytes=80)
    first, last = next(buckets)
    assert ([n for n, _ in first], last, drawn) == (["w0", "w1"], False, [0, 1, 2])
    assert [([n for n, _ in b], last) for b, last in buckets] == [(["w2", "w3"], False), (["w4"], True)]


def test_control_bodies():
    assert proto.update_weights_from_disk_request("/ckpt/step_10") == {"model_path": "/ckpt/step_10", "flush_cache": True}
    assert proto.abort_request(abort_all=True) == {"rid": "", "abort_all": True}
    assert proto.abort_request("req7") == {"rid": "req7", "abort_all": False}
    assert proto.memory_occupation_request(["kv_cache"]) == {"tags": ["kv_cache"]}
    assert proto.memory_occupation_request() == {"tags": None}
    with pytest.raises(ValueError, match="subset"):
        proto.memory_occupation_request(["activations"])
