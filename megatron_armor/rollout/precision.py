"""Weight-precision noise model of a rollout engine: the numerics gap of production engines.

Production inference engines run the policy in bf16 or with FP8-quantized linear weights while the
trainer keeps fp32 master weights, so pi_k != mu_k even right after a weight sync (mipu.md §1).
`quantize_weight` reproduces the weight side of that gap on any device; compute stays in the
engine's dtype:
- "fp32": unchanged.
- "bf16": every tensor rounded to bfloat16 and back.
- "fp8":  matrices (ndim >= 2) rounded to float8_e4m3fn with one fp32 scale per output row
          (scale = amax(|row|) / 448, the e4m3 maximum), like per-channel FP8 weight quantization;
          vectors (norms, biases) stay in bf16 as FP8 engines keep them in higher precision.
The rounding is deterministic, so re-syncing the same trainer weights reproduces the same engine weights.
"""

from __future__ import annotations

from typing import Literal

import torch

EnginePrecision = Literal["fp32", "bf16", "fp8"]
ENGINE_PRECISIONS = ("fp32", "bf16", "fp8")
FP8_E4M3_MAX = 448.0


def quantize_weight(tensor: torch.Tensor, precision: EnginePrecision) -> torch.Tensor:
    """`tensor` rounded through `precision`, returned in its original dtype and shape."""
    if precision == "fp32":
        return tensor
    if precision == "bf16" or tensor.ndim < 2:
        return tensor.to(torch.bfloat16).to(tensor.dtype)
    if precision == "fp8":
        rows = tensor.float().reshape(tensor.shape[0], -1)  # [out, in]
        scale = (rows.abs().amax(dim=1, keepdim=True) / FP8_E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        quantized = (rows / scale).to(torch.float8_e4m3fn).float() * scale
        return quantized.reshape(tensor.shape).to(tensor.dtype)
    raise ValueError(f"unknown engine precision {precision!r}; choose one of {ENGINE_PRECISIONS}")
