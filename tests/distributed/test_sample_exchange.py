"""Samples as packed tensors: exact round trips, the shapes and dtypes of the packing, and the all-gather over two
gloo ranks against `dist.all_gather_object`."""

import struct

import pytest
import torch
import torch.distributed as dist

from launcher import run_workers
from megatron_armor.data.types import Sample
from megatron_armor.distributed import device
from megatron_armor.distributed.device import collective_device
from megatron_armor.distributed.sample_exchange import (
    FINISH_REASONS, PackedSamples, pack_samples, unpack_samples,
)

BIG = 2**63 - 1


def samples() -> list[Sample]:
    """Edge cases: an empty response, an empty prompt, anchors, int64 extremes, floats that float32 would change,
    trajectory numbers (a forked trajectory's segments share one) and none."""
    return [
        Sample(3, [1, 2, 3], [4, 5], [-0.1, -2.5e-8], "stop", False, reward=1.0, correct=True),
        Sample(0, [7], [], [], "length", True, reward=-0.1234567890123, correct=False),
        Sample(9, [], [BIG, 0, -BIG - 1], [-0.0, float("-inf"), 5e-324], "length", False, trajectory=7),
        Sample(2**40, [151_999] * 4, [6], [-1.0000000000000002], "stop", True, reward=0.1, correct=True, trajectory=0),
    ]


def bits(samples: list[Sample]) -> list[tuple]:
    """Every field, floats by their bits (so -0.0 != 0.0 and a float32 rounding shows)."""
    return [(s.prompt_index, s.prompt_ids, s.response_ids, [struct.pack("d", x) for x in s.engine_logprobs],
             s.finish_reason, s.is_anchor, struct.pack("d", s.reward), s.correct, s.trajectory) for s in samples]


def test_round_trip_is_exact_in_every_field_and_type():
    original = samples()
    back = unpack_samples(pack_samples(original))
    assert back == original
    assert bits(back) == bits(original)
    for s in back:
        assert type(s.is_anchor) is bool and type(s.correct) is bool and type(s.reward) is float
        assert all(type(x) is float for x in s.engine_logprobs)


def test_packed_shapes_and_dtypes():
    packed = pack_samples(samples())
    assert (packed.token_ids.dtype, packed.token_ids.shape) == (torch.int64, (3 + 2 + 1 + 0 + 0 + 3 + 4 + 1,))
    assert (packed.engine_logprobs.dtype, packed.engine_logprobs.shape) == (torch.float64, (6,))
    assert packed.lengths.tolist() == [[3, 2], [1, 0], [0, 3], [4, 1]]
    assert packed.scalars.tolist() == [[3, 0, 1, 0, 0, 0, 0, -1], [0, 1, 0, 1, 0, 0, 0, -1], [9, 0, 0, 1, 0, 0, 0, 7],
                                       [2**40, 1, 1, 0, 0, 0, 0, 0]]
    assert packed.routes.shape == (0,) and packed.route_shape == (0, 0) and packed.token_versions.shape == (0,)
    assert packed.loss_masks.shape == (0,)
    assert (packed.rewards.dtype, packed.rewards.shape) == (torch.float64, (4,))
    assert FINISH_REASONS == ("stop", "length")


def test_words_round_trip_ignores_padding_and_holds_no_samples():
    words = pack_samples(samples()).to_words()
    assert words.dtype == torch.int64 and words.numel() == 3 + 11 * 4 + 14 + 6
    padded = torch.cat([words, torch.full((5,), -7, dtype=torch.int64)])
    assert bits(unpack_samples(PackedSamples.from_words(padded))) == bits(samples())
    empty = pack_samples([])
    assert empty.token_ids.shape == (0,) and empty.lengths.shape == (0, 2) and empty.scalars.shape == (0, 8)
    assert unpack_samples(PackedSamples.from_words(empty.to_words())) == []


def test_routed_experts_travel_exactly_and_only_with_the_samples_that_have_them():
    """MoE routes [P + R - 1, L, k] int32 (SGLang's layout) as int32 pairs in the words; samples without keep None."""
    routed = samples()
    g = torch.Generator().manual_seed(0)
    for i in (0, 3):
        fed = len(routed[i].prompt_ids) + len(routed[i].response_ids) - 1
        routed[i].routed_experts = torch.randint(0, 128, (fed, 3, 2), generator=g, dtype=torch.int32)
    words = pack_samples(routed).to_words()
    assert words.numel() == 3 + 11 * 4 + 14 + 6 + (4 + 4) * 3 * 2 // 2
    back = unpack_samples(PackedSamples.from_words(torch.cat([words, torch.full((3,), -7, dtype=torch.int64)])))
    assert bits(back) == bits(routed)
    for mine, theirs in zip(back, routed):
        assert (mine.routed_experts is None) == (theirs.routed_experts is None)
        assert theirs.routed_experts is None or torch.equal(mine.routed_experts, theirs.routed_experts)
    routed[0].routed_experts = routed[0].routed_experts[:-1]
    with pytest.raises(ValueError, match=r"sample 0: routed_experts of shape \(3, 3, 2\), expected \(4, 3, 2\)"):
        pack_samples(routed)


def test_token_versions_travel_exactly_and_only_with_the_samples_that_have_them():
    """Partial rollouts' per-token weight versions ([R] int64) beside routed experts; samples without keep None."""
    versioned = samples()
    versioned[0].token_versions = [3, 4]
    versioned[2].token_versions = [0, 0, BIG]
    versioned[3].routed_experts = torch.arange(4 * 2 * 1, dtype=torch.int32).view(4, 2, 1)
    words = pack_samples(versioned).to_words()
    assert words.numel() == 3 + 11 * 4 + 14 + 6 + 5 + 4 * 2 // 2
    back = unpack_samples(PackedSamples.from_words(torch.cat([words, torch.zeros(2, dtype=torch.int64)])))
    assert [s.token_versions for s in back] == [[3, 4], None, [0, 0, BIG], None]
    assert torch.equal(back[3].routed_experts, versioned[3].routed_experts) and bits(back) == bits(versioned)
    versioned[0].token_versions = [3]
    with pytest.raises(ValueError, match="sample 0: 1 token versions for 2 response tokens"):
        pack_samples(versioned)


def test_loss_masks_travel_exactly_and_only_with_the_samples_that_have_them():
    """A trajectory's per-token loss mask ([R], 1 where the policy sampled the token) beside token versions."""
    masked = samples()
    masked[0].loss_mask = [1, 0]
    masked[2].loss_mask = [0, 1, 1]
    masked[2].token_versions = [5, 6, 7]
    words = pack_samples(masked).to_words()
    assert words.numel() == 3 + 11 * 4 + 14 + 6 + 3 + 5
    back = unpack_samples(PackedSamples.from_words(torch.cat([words, torch.zeros(2, dtype=torch.int64)])))
    assert [s.loss_mask for s in back] == [[1, 0], None, [0, 1, 1], None]
    assert back == masked and bits(back) == bits(masked)
    masked[0].loss_mask = [1, 0, 1]
    with pytest.raises(ValueError, match="sample 0: a loss mask of 3 for 2 response tokens"):
        pack_samples(masked)


def test_unknown_finish_reason_and_mismatched_logprobs_are_refused():
    known = r"known reasons are \('stop', 'length'\)"
    with pytest.raises(ValueError, match=rf"finish_reason 'abort' cannot be packed: {known}"):
        pack_samples([Sample(0, [1], [2], [-1.0], "abort", False)])
    with pytest.raises(ValueError, match="sample 0: 1 engine logprobs for 2 response tokens"):
        pack_samples([Sample(0, [1], [2, 3], [-1.0], "stop", False)])
    with pytest.raises(struct.error):
        pack_samples([Sample(0, [1], [2**63], [-1.0], "stop", False)])


def test_collectives_run_on_the_cpu_under_gloo_and_on_the_training_gpu_under_nccl(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert collective_device() == torch.device("cpu")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(device, "training_device", lambda: torch.device("cuda", 1))
    assert collective_device() == torch.device("cuda", 1)


def test_all_gather_samples_equals_all_gather_object_on_two_ranks(tmp_path):
    results = run_workers("sample_exchange.py", 2, tmp_path)
    for case in ("one_rank_empty", "uneven", "all_empty"):
        assert all(r[case]["same_as_all_gather_object"] for r in results), case
        assert results[0][case]["samples"] == results[1][case]["samples"], case
    assert [len(results[0][case]["samples"]) for case in ("one_rank_empty", "uneven", "all_empty")] == [5, 10, 0]
    assert results[0]["uneven"]["samples"][3]["prompt_index"] == 100  # rank 1's first sample follows rank 0's three
    assert sum(s["loss_mask"] is not None for s in results[0]["uneven"]["samples"]) == 3  # trajectories' masks too
