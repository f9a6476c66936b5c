"""Which optional GPU packages this process can use (detected, never imported at module import)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@dataclass(frozen=True)
class GpuExtras:
    """cuda: a CUDA device is visible; apex: NVIDIA apex's compiled kernels (`amp_C`, not the unrelated
    PyPI package called `apex`), which Megatron uses for fused Adam; the rest by their import names."""

    cuda: bool
    transformer_engine: bool
    apex: bool
    flash_attn: bool
    sglang: bool

    def describe(self) -> str:
        return ", ".join(f"{name}={'yes' if value else 'no'}" for name, value in self.__dict__.items())


def detect_gpu_extras() -> GpuExtras:
    import torch

    return GpuExtras(
        cuda=torch.cuda.is_available(),
        transformer_engine=_has("transformer_engine"),
        apex=_has("amp_C"),
        flash_attn=_has("flash_attn"),
        sglang=_has("sglang"),
    )
