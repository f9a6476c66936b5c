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
