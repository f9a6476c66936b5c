"""Trainer offload (rollout.memory.offload_trainer) on a real Megatron actor, DDP and optimizer in one process:
parking frees every storage of the weights, the optimizer state and the grad buffers; restoring gives
them back bit for bit; training with a park/restore cycle between optimizer steps is bit-identical to
training without one; a forward pass of parked weights is refused.

On the training device: fp32 on CPU; fp32 and bf16 (fp32 master weights in the optimizer) on a GPU,
where scripts/gpu_checks.sh runs this file with deterministic kernels."""

import os

import pytest
import torch

from megatron_armor.convert.loading import load_gpt_model
from megatron_armor.data.types import Sample
from megatron_armor.distributed.device import training_device
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed
from megatron_armor.config import MicroBatchingConfig, OptimizerConfig
from megatron_armor.models.hf_config import load_model_shape
from megatron_armor.scoring.batch import build_sequence_batch
from megatron_armor.scoring.logprobs import ScoringConfig, compute_logprobs
from megatron_armor.trainer.colocation.offload import ParkedWeightsError, TrainerOffload, optimizer_tensors
from megatron_armor.trainer.update.optimizer import subspace_constraint, wrap_for_training
from megatron_armor.trainer.update.policy_update import update_policy
from megatron_armor.scoring.micro_batches import MicroBatching

from algorithm_factory import make_algorithm

OPTIM = OptimizerConfig(lr=1e-3, warmup_steps=0, weight_decay=0.1)
ALGORITHM = make_algorithm("grpo")  # plain dual-clip PPO: no reference logprobs needed
SCORING = ScoringConfig(temperature=1.0, head="torch")
BATCHING = MicroBatching(MicroBatchingConfig(2))


ON_GPU = torch.cuda.is_available()
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (read when its handle is made)
DTYPES = [torch.float32, torch.bfloat16]  # bf16: Megatron's mixed-precision optimizer, fp32 master weights parked too


@pytest.fixture
def megatron_world():
    initialize_distributed(1, 1, 1)
    if ON_GPU:  # bit-identical runs need deterministic kernels (embedding backward accumulates atomically)
        torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)
    destroy_distributed()


def _trainer_state(checkpoint, dtype=torch.float32):
    shape = load_model_shape(checkpoint)
    model = load_gpt_model(checkpoint, shape, params_dtype=dtype, trainable=True)
    ddp, optimizer = wrap_for_training(OPTIM, model=model)
    return ddp, optimizer, load_gpt_model(checkpoint, shape, params_dtype=dtype)


def _batch(vocab_size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    samples = [
        Sample(i // 2, torch.randint(vocab_size, (5,), generator=g).tolist(),
               torch.randint(vocab_size, (3 + i,), generator=g).tolist(), [-1.0] * (3 + i), "stop", False)
        for i in range(4)
    ]
    return build_sequence_batch(samples, [1.0, -1.0, 0.5, -0.5], pad_token_id=0)


def _update(ddp, optimizer, batch, step: int) -> None:
    batch.old_logprobs = compute_logprobs(ddp, batch, micro_batching=BATCHING, scoring=ScoringConfig()).logprobs
    update_policy(ddp, optimizer, [batch], micro_batching=BATCHING, algorithm=ALGORITHM, scoring=SCORING, optim=OPTIM,
                  rl_step=step)


def _snapshot(ddp, optimizer, ref, constraint=None) -> list[torch.Tensor]:
    tensors = [*ddp.module.parameters(), *ref.parameters(), *optimizer_tensors(optimizer)]
    if constraint is not None:
        tensors += [*constraint.initial.values(), *constraint.bases.values()]
    return [t.detach().clone() for t in tensors]


@pytest.mark.parametrize("dtype", DTYPES)
def test_park_frees_every_storage_and_restores_it_bit_for_bit(megatron_world, tiny_model_factory, dtype):
    """fp32: the optimizer updates the model's parameters themselves, which park with the weights; the
    training state is the Adam moments and the subspace constraint's W0 and bases. bf16: the training
    state also holds the optimizer's fp32 master weights."""
    checkpoint = tiny_model_factory("qwen2")
    ddp, optimizer, ref = _trainer_state(checkpoint, dtype)
    constraint = subspace_constraint(ddp.module, 2, "gradient")
    vocab = load_model_shape(checkpoint).vocab_size
    _update(ddp, optimizer, _batch(vocab, 0), 0)  # Adam moments exist from here on
    constraint.capture(1)
    before = _snapshot(ddp, optimizer, ref, constraint)
    moments = [t for t in optimizer_tensors(optimizer, skip={id(p) for p in ddp.module.parameters()}) if t.dim()]
    # exp_avg, exp_avg_sq, and for a bf16 parameter its fp32 master weight
    assert len(moments) == sum(2 if p.dtype == torch.float32 else 3 for p in ddp.module.parameters())

    constrained = [*constraint.initial.values(), *constraint.bases.values()]
    parked = [*ddp.module.parameters(), *ref.parameters(), *optimizer_tensors(optimizer), *constrained,
              *(b.grad_data for b in ddp.buffers)]  # main_grad: views of grad_data
    parked = [t for t in parked if t.device == training_device()]  # not a GPU optimizer's CPU step counters
    expected = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in parked}.values())
    offload = TrainerOffload(ddp, optimizer, {"ref": ref}, constraint)
    offload.park()
    assert all(t.untyped_storage().nbytes() == 0 for t in parked)
    assert offload.metrics()["memory/trainer_parked_gib"] * 2**30 == expected
    with pytest.raises(ParkedWeightsError, match="parked"):
        compute_logprobs(ddp, _batch(vocab, 1), micro_batching=BATCHING, scoring=ScoringConfig())

    with offload.weights_resident("ref"):  # a push of the reference's weights between rollouts
        assert all(p.untyped_storage().nbytes() for p in ref.parameters())
        assert all(p.untyped_storage().nbytes() == 0 for p in [*ddp.module.parameters(), *moments])
    assert all(p.untyped_storage().nbytes() == 0 for p in ref.parameters())

    with offload.training_phase():
        assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(ddp, optimizer, ref, constraint), strict=True))
        assert all(not b.grad_data.any() for b in ddp.buffers)  # dropped and re-zeroed
    # parked again after the phase, but for the actor's weights (the push and the gate read them)
    assert all(t.untyped_storage().nbytes() == 0 for t in [*ref.parameters(), *moments, *constrained])
    assert all(p.untyped_storage().nbytes() for p in ddp.module.parameters())
    with pytest.raises(ParkedWeightsError, match="the ref model"):
        compute_logprobs(ref, _batch(vocab, 1), micro_batching=BATCHING, scoring=ScoringConfig())


@pytest.mark.parametrize("dtype", DTYPES)
def test_training_through_park_cycles_equals_training_without(megatron_world, tiny_model_factory, dtype):
    checkpoint = tiny_model_factory("qwen2")
    vocab = load_model_shape(checkpoint).vocab_size
    finals = []
    for cycle in (False, True):
        ddp, optimizer, ref = _trainer_state(checkpoint, dtype)
        initial = [p.detach().clone() for p in ddp.module.parameters()]
        offload = TrainerOffload(ddp, optimizer, {"ref": ref}) if cycle else None
        for step in range(3):
            if offload is not None:
                offload.park()
                with offload.training_phase():
                    _update(ddp, optimizer, _batch(vocab, step), step)
            else:
                _update(ddp, optimizer, _batch(vocab, step), step)
        if offload is not None:
            offload.restore()
        assert not all(torch.equal(a, b) for a, b in zip(initial, ddp.module.parameters()))  # it trained
        finals.append(_snapshot(ddp, optimizer, ref))
    assert all(torch.equal(a, b) for a, b in zip(*finals, strict=True))
