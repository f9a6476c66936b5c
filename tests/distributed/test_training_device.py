"""Device placement of the Megatron side: one training device, models and micro-batches moved onto it.

No GPU here, so the moves are checked with the meta device standing in for CUDA.
"""

from dataclasses import fields

import pytest
import torch

from launcher import run_workers
from megatron_armor.config import MicroBatchingConfig
from megatron_armor.data.types import Sample
from megatron_armor.distributed.device import training_device
from megatron_armor.models.hf_config import model_shape_from_dict, transformer_config
from megatron_armor.scoring import logprobs
from megatron_armor.scoring.batch import SequenceBatch, build_sequence_batch
from megatron_armor.scoring.micro_batches import MicroBatching

META = torch.device("meta")


def full_batch() -> SequenceBatch:
    """A 2-row batch with every optional field set."""
    samples = [Sample(0, [5, 6], [7, 8], [-0.5, -1.0], "stop", False), Sample(1, [9], [10, 11], [-0.25, -2.0], "stop", True)]
    for sample in samples:  # MoE routes of every fed token: [prompt + response - 1, layers, top-k]
        fed = len(sample.prompt_ids) + len(sample.response_ids) - 1
        sample.routed_experts = torch.arange(fed * 2 * 2, dtype=torch.int32).reshape(fed, 2, 2) % 4
    batch = build_sequence_batch(samples, [1.0, -1.0], pad_token_id=0, pad_to_multiple_of=4)
    for name in ("old_logprobs", "ref_logprobs", "teacher_logprobs", "token_advantages"):
        setattr(batch, name, torch.rand(batch.response_mask.shape))
    return batch


def tensor_fields(batch: SequenceBatch) -> dict[str, torch.Tensor]:
    return {f.name: getattr(batch, f.name) for f in fields(batch)}


def test_training_device_is_the_current_gpu_with_cuda_else_cpu(monkeypatch):
    assert training_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert training_device() == torch.device("cuda", 3)


def test_megatron_initialises_on_the_gpu_only_for_a_cuda_device():
    shape = model_shape_from_dict({"model_type": "qwen2", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
                                   "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 176})
    assert transformer_config(shape).use_cpu_initialization
    assert transformer_config(shape, device=torch.device("cpu")).use_cpu_initialization
    assert not transformer_config(shape, device=torch.device("cuda", 0)).use_cpu_initialization


def test_sequence_batch_to_moves_every_tensor_field():
    batch = full_batch()
    moved = batch.to(META, non_blocking=True)
    for name, tensor in tensor_fields(moved).items():
        original = getattr(batch, name)
        assert tensor.device == META, name
        assert (tensor.dtype, tensor.shape) == (original.dtype, original.shape), name
        assert original.device == torch.device("cpu"), name  # the source batch is left as it was
    assert moved.position_ids.device == META
    assert moved.select(slice(0, 1)).input_ids.device == META
    # On the device it already is on, nothing is copied: CPU runs see the very same tensors.
    same = batch.to(torch.device("cpu"))
    assert all(same_tensor is tensor_fields(batch)[name] for name, same_tensor in tensor_fields(same).items())


@pytest.mark.parametrize("micro_batching", [MicroBatching(MicroBatchingConfig(1)),
                                            MicroBatching(MicroBatchingConfig(2, pack=True))], ids=["rows", "packed"])
def test_forward_backward_feeds_model_and_loss_on_the_training_device(monkeypatch, micro_batching):
    """Every micro-batch reaches the model chunk and the loss function on `training_device()`, packed or not."""
    seen = []

    def chunk(input_ids, position_ids, attention_mask, *, packed_seq_params, output_processor, output_processor_context):
        packing = {} if packed_seq_params is None else {"cu_seqlens": packed_seq_params.cu_seqlens_q}
        seen.append(("model", {"input_ids": input_ids, "position_ids": position_ids,
                               "labels": output_processor_context, **packing}))
        return logprobs.TokenScores(torch.zeros(input_ids.shape, device=META), None)

    def schedule(*, forward_step_func, data_iterator, model, num_microbatches, **_):
        results = []
        for _ in range(num_microbatches):
            output, loss = forward_step_func(data_iterator, model[0])
            results.append(loss(output)[2])
        return results

    def loss_fn(scores, mb):
        seen.append(("loss", tensor_fields(mb)))
        return None, None, {}

    monkeypatch.setattr(logprobs, "training_device", lambda: META)
    monkeypatch.setattr(logprobs, "get_forward_backward_func", lambda: schedule)
    batch = full_batch()
    logprobs.forward_backward(chunk, micro_batching.split(batch), loss_fn,
                              scoring=logprobs.ScoringConfig(head="fused"), forward_only=True)
    per_micro_batch = ["model", "loss"]
    assert [where for where, _ in seen] == per_micro_batch * (2 if micro_batching.settings.micro_batch_size == 1 else 1)
    for where, tensors in seen:
        assert {name: t.device for name, t in tensors.items()} == {name: META for name in tensors}, where


def test_loaded_models_live_on_the_training_device(tiny_model_factory, tmp_path):
    (result,) = run_workers("device_placement.py", 1, tmp_path, str(tiny_model_factory("qwen2")))
    assert result["cpu"] == {"devices": ["cpu"], "cpu_init": True}
    assert result["meta"] == {"devices": ["meta"], "cpu_init": True}  # Megatron initialises on the GPU for CUDA only
