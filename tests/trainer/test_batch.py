"""Sequence packing: label alignment of response masks and engine logprobs."""

import torch

from megatron_armor.data.types import Sample
from megatron_armor.scoring.batch import build_sequence_batch


def test_labels_and_masks_are_next_token_aligned():
    samples = [
        Sample(0, [10, 11, 12], [20, 21], [-0.5, -1.5], "stop", False),
        Sample(0, [13], [22, 23, 24], [-0.125, -0.25, -0.375], "length", True),
    ]
    batch = build_sequence_batch(samples, [1.0, -1.0], pad_token_id=0, pad_to_multiple_of=4)
    assert batch.input_ids.tolist() == [[10, 11, 12, 20, 21, 0, 0, 0], [13, 22, 23, 24, 0, 0, 0, 0]]
    assert batch.labels[:, :-1].tolist() == batch.input_ids[:, 1:].tolist()
    # Response tokens are exactly the labels where the mask is 1.
    for row, sample in enumerate(samples):
        assert batch.labels[row][batch.response_mask[row].bool()].tolist() == sample.response_ids
        assert batch.engine_logprobs[row][batch.response_mask[row].bool()].tolist() == sample.engine_logprobs
    assert batch.is_anchor.tolist() == [False, True]
    assert torch.equal(batch.position_ids[1], torch.arange(8))
    assert batch.select(slice(1, 2)).input_ids.tolist() == [batch.input_ids[1].tolist()]
