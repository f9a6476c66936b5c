"""A LoRA run's checkpoints name their base (path and a fingerprint of its weight files); a resume on a base with
other weights of the same shape, or of a checkpoint without a base, is refused."""

import pytest

from megatron_armor.models.tiny import make_tiny_checkpoint
from megatron_armor.trainer.checkpointing.lora_base import LoRABase


def test_a_resume_on_another_base_is_refused(tmp_path):
    base = make_tiny_checkpoint(tmp_path / "base", seed=0)
    other = make_tiny_checkpoint(tmp_path / "other", seed=1)  # the same architecture, other weights
    saved = LoRABase.of(base).state()
    assert saved["lora_base"]["path"] == str(base)
    LoRABase.of(base).load(saved)  # the same base: accepted
    with pytest.raises(ValueError, match=f"belong to the base model {base}.*other weights"):
        LoRABase.of(other).load(saved)
    with pytest.raises(ValueError, match="names no LoRA base"):
        LoRABase.of(base).load({})
