"""Per-step update geometry (diagnostics/step_geometry.py) on a real Megatron model in one process, against
norms and counts computed by hand over the same matrices; tests/trainer/test_parallel_layouts.py checks that
TP / PP / DP layouts log the same values as one process."""

import math

import pytest
import torch

from megatron_armor.convert.loading import load_gpt_model
from megatron_armor.diagnostics.step_geometry import DECODER_MATRICES, StepGeometry, decoder_matrices
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed
from megatron_armor.models.hf_config import load_model_shape


@pytest.fixture
def actor_and_ref(tiny_model_factory):
    initialize_distributed(1, 1, 1)
    checkpoint = tiny_model_factory("qwen2")
    shape = load_model_shape(checkpoint)
    yield load_gpt_model(checkpoint, shape, trainable=True), load_gpt_model(checkpoint, shape)
    destroy_distributed()


def test_step_geometry_equals_the_hand_computed_norms_and_counts(actor_and_ref):
    actor, ref = actor_and_ref
    matrices = decoder_matrices(actor)
    assert {name.split(".")[-2] for name in matrices} == set(DECODER_MATRICES) and len(matrices) == 8  # 2 layers
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the reference drifts from the start weights by a known offset
        for name, param in decoder_matrices(ref).items():
            param.add_(0.01 * torch.randn(param.shape, generator=g))
    start = {name: w.detach().clone() for name, w in matrices.items()}
    geometry = StepGeometry.capture(actor)
    with torch.no_grad():  # the "update": a large change on half of fc1's rows, a tiny (unchanged in bf16) one elsewhere
        for name, param in matrices.items():
            delta = 1e-7 * torch.ones_like(param)
            if name.endswith("linear_fc1.weight"):
                delta[: param.shape[0] // 2] = 0.05
            param.add_(delta)
    metrics = geometry.metrics(actor, ref)
    refs = decoder_matrices(ref)
    for kind in DECODER_MATRICES:
        names = [name for name in matrices if name.split(".")[-2] == kind]
        update = math.sqrt(sum(float((matrices[n] - start[n]).double().norm() ** 2) for n in names))
        size = math.sqrt(sum(float(start[n].double().norm() ** 2) for n in names))
        drift = math.sqrt(sum(float((matrices[n] - refs[n]).double().norm() ** 2) for n in names))
        ref_size = math.sqrt(sum(float(refs[n].double().norm() ** 2) for n in names))
        assert metrics[f"geometry/{kind}_rel_update"] == pytest.approx(update / size, rel=1e-9)
        assert metrics[f"geometry/{kind}_ref_drift"] == pytest.approx(drift / ref_size, rel=1e-9)
        # a 1e-7 step is below bf16's resolution for these weights: only fc1's moved rows count as changed
        expected = 0.5 if kind == "linear_fc1" else 0.0
        assert metrics[f"geometry/{kind}_changed_fraction"] == pytest.approx(expected, abs=0.01)
    assert metrics["geometry/linear_fc1_rel_update"] > 10 * metrics["geometry/linear_qkv_rel_update"]
