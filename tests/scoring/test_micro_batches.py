"""Token-budget micro-batches and packing (scoring/micro_batches.py): the binning keeps every micro-batch within
its budget and covers every row once; packing concatenates exactly the real tokens; and on a real Megatron
model (one process; layouts in tests/trainer/test_parallel_layouts.py) token-budget and packed micro-batches
give the logprobs, entropy, loss and gradients of whole padded micro-batches."""

import pytest
import torch

from megatron_armor.config import MicroBatchingConfig
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed
from megatron_armor.scoring.logprobs import ScoringConfig, compute_logprobs, forward_backward
from megatron_armor.scoring.micro_batches import MicroBatching, pack_rows

from algorithm_factory import make_algorithm
from sequence_batches import batch_of, rlvr_lengths


@pytest.mark.parametrize("pack", [False, True])
def test_a_long_tailed_length_mix_is_binned_within_the_budget(pack):
    lengths = rlvr_lengths(512, seed=1)
    batching = MicroBatching(MicroBatchingConfig(max_tokens=8192, pack=pack))
    bins = batching.bins(lengths)
    assert sorted(row for b in bins for row in b) == list(range(len(lengths)))  # every row once
    for rows in bins:
        assert len(rows) == 1 or batching.computed_tokens([lengths[r] for r in rows]) <= 8192
    computed = sum(batching.computed_tokens([lengths[r] for r in rows]) for rows in bins)
    padded_whole = len(lengths) * max(lengths)  # one batch padded to its longest row, as before
    assert computed < 0.5 * padded_whole
    if pack:  # packed, only rounding each micro-batch up to a multiple of 8 is padding
        assert computed <= sum(lengths) + 7 * len(bins)


def test_a_row_longer_than_the_budget_gets_a_micro_batch_of_its_own():
    bins = MicroBatching(MicroBatchingConfig(max_tokens=64)).bins([10, 200, 20, 30])
    assert [1] in bins and sorted(r for b in bins for r in b) == [0, 1, 2, 3]


def test_the_config_sets_the_micro_batching_of_the_step():
    from megatron_armor.config import load_config
    from megatron_armor.trainer.run.build import step_plan

    cfg = load_config(None, ["task.synthetic=arithmetic", "micro_batching.micro_batch_size=4",
                             "micro_batching.max_tokens=96", "micro_batching.pack=true", "parallel.tensor_parallel_size=3"])
    plan = step_plan(cfg, make_algorithm("grpo"))
    assert plan.micro_batching == MicroBatching(MicroBatchingConfig(micro_batch_size=4, max_tokens=96, pack=True),
                                                pad_to_multiple_of=24)
    default = step_plan(load_config(None, ["task.synthetic=arithmetic"]), make_algorithm("grpo"))
    assert default.micro_batching == MicroBatching(MicroBatchingConfig(8))


def test_fixed_size_micro_batches_are_consecutive_rows_trimmed_to_their_longest():
    batch = batch_of([5, 20, 9, 7, 30])
    micro = MicroBatching(MicroBatchingConfig(micro_batch_size=2)).split(batch)
    assert [mb.row_index.tolist() for mb in micro] == [[0, 1], [2, 3], [4]]
    assert [tuple(mb.rows.input_ids.shape) for mb in micro] == [(2, 24), (2, 16), (1, 32)]
    for mb in micro:
        width = mb.rows.input_ids.shape[1]
        assert torch.equal(mb.rows.input_ids, batch.input_ids[mb.row_index, :width])
        assert batch.response_mask[mb.row_index, width:].sum() == 0  # nothing real was cut


def test_packing_concatenates_exactly_the_real_tokens():
    lengths = [5, 11, 3]
    rows = batch_of(lengths)
    packed = pack_rows(rows, pad_to_multiple_of=8)
    assert packed.input_ids.shape == (1, 24)
    assert packed.cu_seqlens.tolist() == [0, 5, 16, 19, 24]  # three sequences, then the padding tail
    assert packed.cu_seqlens.dtype == torch.int32 and packed.max_seqlen == 11
    expected_ids = torch.cat([rows.input_ids[i, :n] for i, n in enumerate(lengths)])
    expected_labels = torch.cat([rows.labels[i, :n] for i, n in enumerate(lengths)])
    assert torch.equal(packed.input_ids[0, :19], expected_ids)
    assert torch.equal(packed.labels[0, :19], expected_labels)
    assert packed.labels[0, 4] == 0  # a sequence's last token predicts padding, not the next sequence
    assert packed.position_ids[0].tolist() == [*range(5), *range(11), *range(3), *range(5)]
    micro = MicroBatching(MicroBatchingConfig(micro_batch_size=3, pack=True)).split(rows)[0]
    values = torch.arange(24.0)[None, :]
    unpacked = micro.unpack(values)  # [3, 16]: packed token j back at its row and column
    for i, n in enumerate(lengths):
        start = [0, 5, 16][i]
        assert torch.equal(unpacked[i, :n], values[0, start:start + n])
        assert unpacked[i, n:].sum() == 0


@pytest.fixture
def tiny_actor(tiny_model_factory):
    from megatron_armor.convert.loading import load_gpt_model
    from megatron_armor.models.hf_config import load_model_shape

    initialize_distributed(1, 1, 1)
    checkpoint = tiny_model_factory("qwen2")
    yield load_gpt_model(checkpoint, load_model_shape(checkpoint), trainable=True)
    destroy_distributed()


LAYOUTS = {
    "padded": MicroBatching(MicroBatchingConfig(micro_batch_size=7)),  # the reference: whole rows, one micro-batch
    "fixed": MicroBatching(MicroBatchingConfig(micro_batch_size=2)),
    "budget": MicroBatching(MicroBatchingConfig(max_tokens=48)),
    "packed": MicroBatching(MicroBatchingConfig(micro_batch_size=3, pack=True)),
    "budget-packed": MicroBatching(MicroBatchingConfig(max_tokens=40, pack=True)),
}


def test_token_budget_and_packed_micro_batches_score_and_train_as_padded_ones(tiny_actor):
    """Logprobs and entropy of every row, and the ARMOR loss and gradients of the batch, agree across layouts."""
    batch = batch_of([6, 31, 9, 17, 4, 25, 12])
    scoring = ScoringConfig(with_entropy=True)
    algorithm = make_algorithm("grpo")
    from megatron_armor.trainer.update.policy_update import PolicyLossCallback

    results = {}
    for name, batching in LAYOUTS.items():
        scored = compute_logprobs(tiny_actor, batch, micro_batching=batching, scoring=scoring)
        batch.old_logprobs = scored.logprobs.detach() - 0.01  # a ratio away from 1, the same for every layout
        tiny_actor.zero_grad()
        outputs = forward_backward(tiny_actor, batching.split(batch), PolicyLossCallback(algorithm), scoring=scoring,
                                   forward_only=False)
        loss = sum(float(out["loss/policy_loss"]) for out in outputs)
        grads = {n: p.grad.clone() for n, p in tiny_actor.named_parameters() if p.grad is not None}
        results[name] = (scored.logprobs, scored.entropy, loss, grads)
    reference = results.pop("padded")
    assert reference[0].abs().sum() > 0 and reference[3]
    for name, (logprobs, entropy, loss, grads) in results.items():
        torch.testing.assert_close(logprobs, reference[0], atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(entropy, reference[1], atol=1e-5, rtol=0, msg=name)
        assert loss == pytest.approx(reference[2], rel=1e-5, abs=1e-7), name
        assert grads.keys() == reference[3].keys()
        for param, grad in grads.items():  # fp32 sums over other micro-batches: relative to the largest entry
            scale = float(reference[3][param].abs().max())
            torch.testing.assert_close(grad, reference[3][param], rtol=1e-4, atol=1e-5 * scale,
                                       msg=lambda m: f"{name} {param}: {m}")
