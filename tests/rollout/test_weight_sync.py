"""sync_weights: the engine gets every tensor, the report counts them."""

import torch

from megatron_armor.rollout.local import LocalEngine
from megatron_armor.rollout.weight_sync import sync_weights


def test_sync_weights_reports_bytes_and_updates_the_engine(tiny_model_factory):
    engine = LocalEngine(tiny_model_factory("qwen2"))
    new = {name: torch.randn_like(p) for name, p in engine.named_parameters_hf().items()}
    report = sync_weights(engine, iter(new.items()))
    assert report.tensors == len(new) and report.bytes == sum(t.nbytes for t in new.values())
    assert report.metrics()["perf/weight_sync_bytes"] == report.bytes and report.seconds > 0
    assert all(torch.equal(engine.named_parameters_hf()[name], t) for name, t in new.items())
