"""Shared fixtures: tiny HF checkpoints made locally (no hub access)."""

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors only in its interpreter, which must be chosen before triton is
    # first imported (Megatron imports it), so before any test module is collected.
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))  # the shared `launcher` helper


def pytest_configure(config):
    config.addinivalue_line("markers", "torchrun: conversions in this test launch their workers under torchrun, as "
                                       "users' do (the other tests fork them from the launcher's zygote)")


@pytest.fixture(autouse=True)
def conversion_workers_from_the_zygote(request, monkeypatch, tmp_path_factory):
    """A multi-process conversion's ranks forked from the suite's pre-imported zygote (tests/launcher.py) instead of
    torchrun's fresh interpreters: the same worker command (`python -m megatron_armor.convert.cli ... --worker`) and
    environment, without ~8 s of imports per launch on this 2-core box. Tests marked `torchrun` keep torchrun; the
    conversion tools run as users run them (tests/convert/test_round_trip.py) launch it from their own process."""
    if request.node.get_closest_marker("torchrun"):
        return
    from launcher import launch

    from megatron_armor.convert import workers

    def run_conversion_workers(nproc: int, cli_args, *, failure: str) -> None:
        result = launch(["-m", "megatron_armor.convert.cli", *cli_args], nproc,
                        tmp_path_factory.mktemp("conversion-workers"), env={"CUDA_VISIBLE_DEVICES": ""})
        if result.returncode != 0:
            sys.stderr.write(result.output)
            raise workers.ConversionError(failure)

    monkeypatch.setattr(workers, "run_conversion_workers", run_conversion_workers)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """(arch, **make_tiny_checkpoint options) -> directory of a tiny random HF checkpoint (made once per session)."""
    from megatron_armor.models.tiny import make_tiny_checkpoint

    made: dict[tuple, Path] = {}

    def make(arch: str = "qwen2", **options) -> Path:
        key = (arch, repr(sorted(options.items())))
        if key not in made:
            made[key] = make_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch, seed=0, **options)
        return made[key]

    return make


@pytest.fixture(scope="session")
def prepackable_model(tiny_model_factory):
    """A small Qwen2 checkpoint whose MLP and LM head are large enough for the in-process engine to prepack (>= 2^17
    weights: rollout/prepacked_linear.py) while its attention projections are not."""
    return tiny_model_factory("qwen2", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=768, vocab_size=1024)


@pytest.fixture(scope="session")
def synthetic_cache(tmp_path_factory):
    """One synthetic-task cache (tiny model + warm start) shared by every training-run test."""
    return tmp_path_factory.mktemp("armor-cache")
