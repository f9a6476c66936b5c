"""SGLang request bodies and response parsing against payloads written from SGLang 0.5.15's schema."""

import base64
import io

import pytest
import torch

from megatron_armor.rollout import sglang_protocol as proto
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


def test_generate_request_without_seed_omits_sampling_seed():
    body = proto.generate_request([[1]], SamplingParams(temperature=0.0))
    assert "sampling_seed" not in body["sampling_params"][0] and "rid" not in body
    with pytest.raises(ValueError, match="2 indices for 1 prompts"):
        proto.generate_request([[1]], SamplingParams(), indices=[0, 1])


def test_parse_batch_reply_reads_logprob_triples_and_finish_types():
    out = proto.parse_generate_response(PROMPTS, SGLANG_BATCH_REPLY)
    assert out[0] == Generation([1, 2, 3], [791, 6864, 151643], [-0.5, -1.25, -0.015625], "stop")
    assert out[1] == Generation([4, 5], [11, 12], [-2.0, -3.5], "length")
    assert out[2] == proto.Aborted("Abort before prefill")


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


def test_flattened_bucket_layout_matches_sglang_metadata():
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = torch.tensor([1.0, -2.0, 3.5, 0.25], dtype=torch.bfloat16)
    c = torch.tensor([7], dtype=torch.int64)
    bucket = proto.flatten_bucket([("a", a), ("b", b), ("c", c)])
    assert bucket["flattened_tensor"].dtype == torch.uint8 and bucket["flattened_tensor"].shape == (40,)
    assert bucket["metadata"] == [
        {"name": "a", "shape": (2, 3), "dtype": "float32", "start_idx": 0, "end_idx": 24, "numel": 24},
        {"name": "b", "shape": (4,), "dtype": "bfloat16", "start_idx": 24, "end_idx": 32, "numel": 8},
        {"name": "c", "shape": (1,), "dtype": "int64", "start_idx": 32, "end_idx": 40, "numel": 8},
    ]
    restored = proto.unflatten_bucket(bucket)
    assert [n for n, _ in restored] == ["a", "b", "c"]
    for (_, got), want in zip(restored, (a, b, c)):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_update_weights_from_tensor_body_one_entry_per_tp_rank(load_format):
    tensors = [("model.norm.weight", torch.randn(8)), ("lm_head.weight", torch.randn(4, 8, dtype=torch.bfloat16))]
    body = proto.update_weights_from_tensor_request(tensors, tp_size=2, load_format=load_format, flush_cache=False)
    assert body["load_format"] == load_format and body["flush_cache"] is False
    entries = body["serialized_named_tensors"]
    assert len(entries) == 2 and entries[0] == entries[1]
    for rank in (0, 1):
        decoded = proto.named_tensors_from_request(body, tp_rank=rank)
        assert [n for n, _ in decoded] == [n for n, _ in tensors]
        assert all(torch.equal(got, want) for (_, got), (_, want) in zip(decoded, tensors))
    with pytest.raises(ValueError, match="TP rank 2"):
        proto.named_tensors_from_request(body, tp_rank=2)


def test_tensor_payload_decoder_refuses_code():
    class Payload:
        def __reduce__(self):
            return (print, ("this must never run",))

    buffer = io.BytesIO()
    torch.save([("x", Payload())], buffer)
    with pytest.raises(Exception, match="Weights only load failed"):
        proto.decode_tensor_payload(base64.b64encode(buffer.getvalue()).decode())


def test_bucketing_respects_byte_budget_and_order():
    tensors = [(f"w{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 5])]  # float32: 40, 40, 120, 20, 20 bytes
    buckets = proto.bucket_named_tensors(tensors, bucket_bytes=80)
    assert [[name for name, _ in b] for b in buckets] == [["w0", "w1"], ["w2"], ["w3", "w4"]]
    assert proto.bucket_named_tensors([], 80) == []


def test_control_bodies():
    assert proto.update_weights_from_disk_request("/ckpt/step_10") == {"model_path": "/ckpt/step_10", "flush_cache": True}
    assert proto.abort_request(abort_all=True) == {"rid": "", "abort_all": True}
    assert proto.abort_request("req7") == {"rid": "req7", "abort_all": False}
    assert proto.memory_occupation_request(["kv_cache"]) == {"tags": ["kv_cache"]}
    assert proto.memory_occupation_request() == {"tags": None}
    with pytest.raises(ValueError, match="subset"):
        proto.memory_occupation_request(["activations"])
