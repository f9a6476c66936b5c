"""The base model a LoRA run's adapters belong to: named in every checkpoint, and a resume on another base refused
(its adapters would be applied to weights they were not trained on)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SAMPLED_BYTES = 1 << 20  # of each weight file, its first and last MiB enter the fingerprint
WEIGHT_SUFFIXES = (".safetensors", ".distcp")  # HF checkpoints' and Megatron distributed checkpoints' weight files
STATE_KEY = "lora_base"


def base_fingerprint(path: str | Path) -> str:
    """sha256 over the weight files under `path` (an HF or Megatron checkpoint directory): each file's relative name,
    size, and first and last `SAMPLED_BYTES` bytes, in name order. Two trainings of one architecture differ there
    (the bytes are tensor data after a short header); reading 2 MiB per file keeps it cheap for large models."""
    root, digest = Path(path), hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES):
        size = file.stat().st_size
        digest.update(f"{file.relative_to(root)}:{size}".encode())
        with file.open("rb") as handle:
            digest.update(handle.read(SAMPLED_BYTES))
            handle.seek(max(size - SAMPLED_BYTES, 0))
            digest.update(handle.read(SAMPLED_BYTES))
    return digest.hexdigest()


@dataclass(frozen=True)
class LoRABase:
    """A run tracker (state rides in every checkpoint's trainer_state.json): the base's `path` (model.path) and its
    `fingerprint` (`base_fingerprint`)."""

    path: str
    fingerprint: str

    @classmethod
    def of(cls, path: str | Path) -> LoRABase:
        return cls(str(path), base_fingerprint(path))

    def state(self) -> dict[str, Any]:
        return {STATE_KEY: {"path": self.path, "fingerprint": self.fingerprint}}

    def load(self, state: dict[str, Any]) -> None:
        """Accept a checkpoint whose adapters belong to this base; raise ValueError for another base, or for a
        checkpoint of a run without LoRA."""
        saved = state.get(STATE_KEY)
        if saved is None:
            raise ValueError("the checkpoint names no LoRA base: a run without model.lora saved it; resume it without "
                             "model.lora")
        if saved["fingerprint"] != self.fingerprint:
            raise ValueError(f"the checkpoint's adapters belong to the base model {saved['path']}, and model.path "
                             f"{self.path} holds other weights: resume with that base")
