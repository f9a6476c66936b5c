"""Random LM-head problems and tolerances shared by the kernel tests and the tensor-parallel worker.

Problems live on `DEVICE`: the GPU when there is one (compiled kernels), else the CPU (Triton's
interpreter). They are drawn on the CPU first, so a seed gives the same numbers on both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_armor.kernels.reference import IGNORE_INDEX

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class Case:
    """hidden [N, H], weight [V, H] in `dtype`; labels [N] (some IGNORE_INDEX); RL inputs [N] float32."""

    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    old_logp: torch.Tensor
    ref_logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor


def make_case(n: int, v: int, h: int, dtype: torch.dtype, seed: int = 0) -> Case:
    """Logits of std ~2 (softmax neither flat nor one-hot); old/ref logprobs near the true ones so that
    ratios land on both sides of the clip range."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 2 / h**0.5).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.2] = IGNORE_INDEX
    with torch.no_grad():
        logits = hidden.double() @ weight.double().T
        true_logp = torch.log_softmax(logits, -1).gather(1, labels.clamp(min=0)[:, None]).squeeze(1).float()
    old_logp = true_logp + 0.3 * torch.randn(n, generator=g)
    ref_logp = true_logp + 0.5 * torch.randn(n, generator=g)
    advantages = torch.randn(n, generator=g)
    mask = ((torch.rand(n, generator=g) > 0.2) & (labels != IGNORE_INDEX)).float()
    return Case(*(t.to(DEVICE) for t in (hidden, weight, labels, old_logp, ref_logp, advantages, mask)))


def randn(*shape: int, seed: int) -> torch.Tensor:
    """A float32 standard-normal tensor on `DEVICE`, the same for a seed on CPU and GPU."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def pad_vocab(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """weight [V, H] with `rows` padding rows appended, as Megatron pads the vocabulary. They hold large values
    (logits of std ~100 against `make_case`'s hidden) so that a padding row leaking into a max, a sum or a
    gradient shows."""
    g = torch.Generator().manual_seed(99)
    padding = 12 * torch.randn(rows, weight.shape[1], generator=g)
    return torch.cat([weight, padding.to(weight)])


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    """Tolerances against the float32 reference run on the same (upcast) inputs.

    forward (logprobs, entropy; absolute): both sides sum exact float32 products in different orders, so the
    error is a few float32 ulps of the logits and of log-sum-exp over V terms: ~1e-6; allow 1e-4 at any
    dtype.
    grad (relative to the largest reference entry): float32 inputs differ only by summation order (~1e-6 over
    5e4 terms; allow 1e-4);
    16-bit inputs round dz to the input dtype before the gradient GEMMs and round the result (bf16 unit
    roundoff 2^-8 each), so allow 2^-6 of the gradient's scale.
    """
    return {"forward": 1e-4, "grad": 1e-4 if dtype == torch.float32 else 2.0**-6}


def assert_grad_close(actual: torch.Tensor, expected: torch.Tensor, rel: float, what: str) -> None:
    scale = expected.abs().max().item()
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= rel * max(scale, 1e-12), f"{what}: max error {err:.3g} > {rel:.3g} x scale {scale:.3g}"
