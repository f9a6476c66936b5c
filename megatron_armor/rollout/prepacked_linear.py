"""Linear layers that run on CPU with weights laid out once for oneDNN's matrix products.

`torch.nn.functional.linear` on the CPU calls MKL's general matrix product, which reads the weight in its
[out, in] row-major layout on every call. A decode step multiplies every weight by a handful of rows (one token
per sequence), so it is bound by how the weight streams through the caches. `PrepackedLinear` runs the product as
oneDNN's inner product on a copy of the weight laid out once for it (timings of both, and of whole generations:
docs/benchmarks.md, "Rollout engine" and "Figures formerly in code"; benchmarks/bench_rollout.py --vs-hf).

The products stay float32 with float32 accumulation; oneDNN sums in another order than MKL, so outputs may differ
from `F.linear`'s in the last bits (engine logprobs by a few 1e-6: tests/rollout/test_prepacked_linear.py). A row's
output does not depend on how many rows are multiplied with it (tests/rollout/test_prepacked_linear.py checks
it), which MKL does not guarantee for small batches.

`PrepackedLinear` holds the very `weight` and `bias` Parameters of the `nn.Linear` it replaces (names, tied
weights and in-place weight updates carry over; hooks on the replaced `nn.Linear` itself do not). It lays the weight
out again whenever it changed since the last layout (its storage or its version counter: `copy_` in
`LocalEngine.update_weights`); a write that bypasses both (into the storage's bytes, or in place through `.data`)
needs `drop_layout`. The layout costs one more copy of every prepacked weight in CPU memory; `drop_layouts` frees
them (serve-local's memory release); copies and pickles of the module leave it behind. Inputs that are not float32
CPU tensors (a GPU engine, bf16), inference-mode weights, and any forward that needs gradients go through
`F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def prepacking_available() -> bool:
    """Whether this torch build has oneDNN's CPU linear on laid-out weights."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PrepackedLinear(torch.nn.Linear):
    """`nn.Linear` whose float32 CPU forward uses a oneDNN layout of the weight made once per weight value."""

    @classmethod
    def sharing(cls, linear: torch.nn.Linear) -> PrepackedLinear:
        """A `PrepackedLinear` over `linear`'s own weight and bias Parameters (nothing is copied)."""
        packed = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        packed.weight, packed.bias = linear.weight, linear.bias
        return packed.train(linear.training)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # ((data_ptr, _version) of the weight it was made from, the oneDNN copy of `weight` [out, in] float32): one
        # attribute, so a forward on another thread reads a key and a layout that belong together
        self._layout: tuple[tuple[int, int], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in] -> [..., out]."""
        weight, bias = self.weight, self.bias
        parameters = (weight,) if bias is None else (weight, bias)
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, *parameters))  # oneDNN: no backward
        float32_cpu = x.device.type == "cpu" and all(t.dtype == torch.float32 for t in (x, *parameters))
        if needs_grad or not float32_cpu or weight.is_inference() or not x.numel():
            return F.linear(x, weight, bias)
        key = (weight.data_ptr(), weight._version)
        layout = self._layout
        if layout is None or layout[0] != key:
            layout = self._layout = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach()))
        bias = None if bias is None else bias.detach()
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), layout[1], bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def drop_layout(self) -> None:
        """Free the laid-out copy (the next CPU forward makes it again from the weight as it is then)."""
        self._layout = None

    def __getstate__(self) -> dict:
        """Copies and pickles without the layout (an opaque oneDNN tensor neither can take); they make their own."""
        return {**self.__dict__, "_layout": None}


# The smallest weight (in elements) that gets a oneDNN layout: oneDNN's call costs a fixed amount more than MKL's
# whatever the size, which smaller products do not earn back (timings: docs/benchmarks.md, "Figures formerly in code").
PREPACK_MIN_WEIGHT_ELEMENTS = 1 << 17


def prepack_linears(model: torch.nn.Module, min_weight_elements: int = PREPACK_MIN_WEIGHT_ELEMENTS) -> int:
    """Replace every `nn.Linear` (the exact class, not subclasses) in `model` whose weight has at least
    `min_weight_elements` elements by a `PrepackedLinear` over the same Parameters; returns how many were replaced
    (0 where `prepacking_available()` is False)."""
    if not prepacking_available():
        return 0
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and child.weight.numel() >= min_weight_elements:
                setattr(parent, name, PrepackedLinear.sharing(child))
                replaced += 1
    return replaced


def drop_layouts(model: torch.nn.Module) -> None:
    """Free the laid-out weight copies of every `PrepackedLinear` in `model`."""
    for module in model.modules():
        if isinstance(module, PrepackedLinear):
            module.drop_layout()
