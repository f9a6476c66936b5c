"""Subspace-constrained training (spec opd.md §3): confine later updates to an early update's top-K span.

At a chosen step, V_K = the top-K right singular vectors of each matrix's cumulative update W_t - W0 are
recorded; from then on every step is projected onto span(V_K) from the right, in one of two modes:
- "gradient": before the optimizer step, g <- g V V^T (Adam's elementwise scaling then acts on the
  projected gradient, so the step itself may leave the span);
- "update": after the optimizer step, W <- W_prev + (W - W_prev) V V^T (the step stays in the span).
Which mode ran is part of `summary()`, to be logged with the run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch

from megatron_armor.diagnostics.geometry import top_right_vectors

PROJECTION_MODES = ("gradient", "update")


def record_subspace(delta: torch.Tensor, k: int) -> torch.Tensor:
    """V_K [in, k] float32 on delta's device: top-k right singular vectors of delta [out, in] (float64 SVD)."""
    return top_right_vectors(delta, k).to(delta.device, torch.float32)


def project_gradient(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """g V V^T for g [out, in] and orthonormal V [in, k]; computed in V's dtype, returned in g's dtype."""
    if g.dim() != 2 or g.shape[1] != v.shape[0]:
        raise ValueError(f"cannot project a {tuple(g.shape)} matrix onto a basis of shape {tuple(v.shape)}")
    return ((g.to(v.dtype) @ v) @ v.T).to(g.dtype)


def _grad_of(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient buffer the optimizer reads: Megatron DDP's `main_grad` if present, else `.grad`."""
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


class SubspaceConstraint:
    """Projects the steps of the given 2-D parameters onto span(V_K) once `capture` has run.

    Call `pre_step()` before and `post_step()` after every optimizer step (both are no-ops until a
    capture and outside their mode), and `capture(step)` once at the chosen early step.

    params:  name -> parameter [out, in] (updated in place by the optimizer)
    initial: name -> W0 [out, in] for the same names (any device, kept as given; pass copies)
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        initial: Mapping[str, torch.Tensor],
        k: int = 16,
        mode: Literal["gradient", "update"] = "gradient",
    ) -> None:
        if mode not in PROJECTION_MODES:
            raise ValueError(f"unknown projection mode {mode!r}; choose one of {PROJECTION_MODES}")
        if set(params) != set(initial):
            raise ValueError(
                f"params and initial weights must name the same matrices; only in params: "
                f"{sorted(set(params) - set(initial))[:5]}, only in initial: {sorted(set(initial) - set(params))[:5]}"
            )
        for name, param in params.items():
            if param.dim() != 2 or param.shape != initial[name].shape:
                raise ValueError(
                    f"{name}: needs a 2-D parameter matching its initial weight, got {tuple(param.shape)} "
                    f"and {tuple(initial[name].shape)}"
                )
        self.params = dict(params)
        self.initial = dict(initial)
        self.k = k
        self.mode = mode
        self.captured_step: int | None = None
        self.projected_steps = 0
        self.bases: dict[str, torch.Tensor] = {}  # name -> V_K [in, k] float32
        self._before: dict[str, torch.Tensor] = {}  # name -> W_prev, "update" mode only

    def capture(self, step: int) -> None:
        """Record V_K of W_t - W0 for every matrix; later steps are projected."""
        self.bases = {  # the difference in float64, so a bf16 parameter loses nothing to rounding
            name: record_subspace(param.detach().double() - self.initial[name].to(param.device, torch.float64), self.k)
            for name, param in self.params.items()
        }
        self.captured_step = step

    def pre_step(self) -> None:
        """Before optimizer.step(): "gradient" mode projects each gradient in place; "update" saves W_prev."""
        if not self.bases:
            return
        if self.mode == "update":
            self._before = {name: param.detach().clone() for name, param in self.params.items()}
            return
        for name, param in self.params.items():
            grad = _grad_of(param)
            if grad is None:
                raise RuntimeError(f"{name}: no gradient to project (neither .main_grad nor .grad is set)")
            grad.copy_(project_gradient(grad, self.bases[name]))
        self.projected_steps += 1

    def post_step(self) -> None:
        """After optimizer.step(): "update" mode replaces each step W - W_prev by (W - W_prev) V V^T."""
        if not self.bases or self.mode != "update":
            return
        with torch.no_grad():
            for name, param in self.params.items():
                before = self._before[name].float()
                param.copy_(before + project_gradient(param.float() - before, self.bases[name]))
        self._before = {}
        self.projected_steps += 1

    def state_dict(self) -> dict:
        """What a resumed run needs: W0, the recorded bases and the counters."""
        return {"initial": self.initial, "bases": self.bases, "captured_step": self.captured_step,
                "projected_steps": self.projected_steps}

    def load_state_dict(self, state: dict) -> None:
        self.initial, self.bases = dict(state["initial"]), dict(state["bases"])
        self.captured_step, self.projected_steps = state["captured_step"], state["projected_steps"]

    def summary(self) -> dict:
        """What ran, for the run's metrics: mode, K, the capture step and how many steps were projected."""
        return {"mode": self.mode, "k": self.k, "captured_step": self.captured_step,
                "projected_steps": self.projected_steps, "matrices": len(self.params)}
