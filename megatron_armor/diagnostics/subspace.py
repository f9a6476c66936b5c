"""Subspace-constrained training (spec opd.md §3): confine later updates to an early update's top-K span.

At a chosen step, V_K = the top-K right singular vectors of each matrix's cumulative update W_t - W0 are
recorded; from then on every step is projected onto span(V_K) from the right, in one of two modes:
- "gradient": before the optimizer step, g <- g V V^T (Adam's elementwise scaling then acts on the
  projected gradient, so the step itself may leave the span);
- "update": after the optimizer step, W <- W_prev + (W - W_prev) V V^T (the step stays in the span).
Which mode ran is part of `summary()`, to be logged with the run.

W is the copy of a parameter that the optimizer steps: under Megatron's mixed-precision optimizer
the fp32 master (`param.main_param`, which its next step copies onto the bf16 parameter, so a
projection of the parameter alone would be undone), else the parameter itself. "update" mode
projects W and copies it onto the parameter; `capture` reads the cumulative update from W.

Fused matrices (a deviation from opd.md §2-3, which projects q, k, v and gate, up as separate
matrices, as `armor diagnose` analyses them): the trainer passes Megatron's parameters as they are,
so linear_qkv ([q; k; v] rows, interleaved per query group) and linear_fc1 ([gate; up]) are each one
matrix with one V_K [hidden, K] of the fused update. V spans input directions shared by all row
blocks, so each block's step is kept in the top-K input span of the stacked update [dq; dk; dv]
rather than in that of its own update (one K-dim span where per-block bases would allow up to 3K
directions in total). linear_proj and linear_fc2 are single HF matrices (o_proj, down_proj), as in
the spec. Per-block bases would need the fused row layout (heads, groups, TP slicing), which the
trainer's `subspace_constraint` does not pass.

Under tensor parallelism each rank holds a shard of a matrix and the bases are those of the full
matrix (`Sharding`): a column-parallel shard (output rows split) keeps the whole V [in, K],
replicated; a row-parallel shard (input columns split) keeps its row block of V [in/tp, K], and
g V V^T needs one all-reduce of the partial products g_r V_r [out, K] over the group.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from megatron_armor.diagnostics.geometry import top_right_vectors

PROJECTION_MODES = ("gradient", "update")


@dataclass(frozen=True)
class Sharding:
    """How a matrix [out, in] is split over the ranks of `group`: along `dim` 0 (output rows,
    column-parallel) or 1 (input columns, row-parallel), rank r holding the r-th block."""

    dim: int
    group: dist.ProcessGroup

    def __post_init__(self) -> None:
        if self.dim not in (0, 1):
            raise ValueError(f"a matrix is split along dim 0 or 1, got {self.dim}")


def gather_full(shard: torch.Tensor, sharding: Sharding | None) -> torch.Tensor:
    """The full matrix from every rank's shard (collective over `sharding.group`); `shard` itself if None.

    The blocks are concatenated in rank order, which is the full matrix up to a permutation of its
    rows (dim 0) or columns (dim 1), e.g. for a fused or strided layout. Right singular vectors do
    not see a row permutation, and a column permutation permutes V's rows consistently with the
    shards, so the bases below are exact for any layout.
    """
    if sharding is None:
        return shard
    blocks = [torch.empty_like(shard) for _ in range(dist.get_world_size(sharding.group))]
    dist.all_gather(blocks, shard.contiguous(), group=sharding.group)
    return torch.cat(blocks, dim=sharding.dim)


def record_subspace(delta: torch.Tensor, k: int, sharding: Sharding | None = None) -> torch.Tensor:
    """V_K float32 on delta's device: top-k right singular vectors of the full matrix (float64 SVD).

    delta: [out, in], or this rank's shard of it per `sharding` (collective then: the full matrix
    is gathered, its V is broadcast from the group's first rank so every rank uses the same one).
    Returns [in, k]; for a row-parallel shard [in/tp, k], this rank's row block.
    """
    full = gather_full(delta, sharding)
    v = top_right_vectors(full, k).to(delta.device, torch.float32).contiguous()  # [in_full, k]
    if sharding is None:
        return v
    dist.broadcast(v, src=dist.get_global_rank(sharding.group, 0), group=sharding.group)
    if sharding.dim == 0:
        return v
    return v.chunk(dist.get_world_size(sharding.group))[dist.get_rank(sharding.group)].contiguous()


def project_gradient(g: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """g V V^T for g [out, in] and orthonormal V [in, k]; computed in V's dtype, returned in g's dtype.

    With `group` (row-parallel shards), g is this rank's column block [out, in/tp] and V the matching
    row block [in/tp, k]: g V = sum_r g_r V_r is all-reduced over the group, and the result is this
    rank's column block of the full projection.
    """
    if g.dim() != 2 or g.shape[1] != v.shape[0]:
        raise ValueError(f"cannot project a {tuple(g.shape)} matrix onto a basis of shape {tuple(v.shape)}")
    gv = g.to(v.dtype) @ v  # [out, k]
    if group is not None:
        dist.all_reduce(gv, group=group)
    return (gv @ v.T).to(g.dtype)


def _stepped_weights(param: torch.Tensor) -> torch.Tensor:
    """The copy of `param` [out, in] the optimizer steps: Megatron's fp32 master `main_param` under its
    mixed-precision optimizer, else `param`."""
    if getattr(param, "main_param_sharded", False):
        raise NotImplementedError("subspace constraint: the distributed optimizer holds flat shards of the master "
                                  "weights, which cannot be projected as matrices; train without it")
    main = getattr(param, "main_param", None)
    return param if main is None else main


def _grad_of(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient buffer the optimizer reads: Megatron DDP's `main_grad` if present, else `.grad`."""
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


class SubspaceConstraint:
    """Projects the steps of the given 2-D parameters onto span(V_K) once `capture` has run.

    Call `pre_step()` before and `post_step()` after every optimizer step (both are no-ops until a
    capture and outside their mode), and `capture(step)` once at the chosen early step.

    params:   name -> parameter [out, in] (updated in place by the optimizer, or through its
              fp32 master copy `main_param`)
    initial:  name -> W0 [out, in] for the same names (any device, kept as given; pass copies)
    sharding: name -> `Sharding` of the tensor-parallel shards among `params` (absent: a whole
              matrix); capture and projection are then collectives over each shard's group.
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        initial: Mapping[str, torch.Tensor],
        k: int = 16,
        mode: Literal["gradient", "update"] = "gradient",
        sharding: Mapping[str, Sharding] | None = None,
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
        sharding = dict(sharding or {})
        if not set(sharding) <= set(params):
            raise ValueError(f"sharding names matrices that are not in params: {sorted(set(sharding) - set(params))[:5]}")
        self.params = dict(params)
        self.initial = dict(initial)
        self.sharding = sharding
        self.rank = k  # K: the dimension of the span updates are confined to
        self.mode = mode
        self.captured_step: int | None = None
        self.projected_steps = 0
        self.bases: dict[str, torch.Tensor] = {}  # name -> V_K [in, k] float32 ([in/tp, k] row-parallel)
        self._before: dict[str, torch.Tensor] = {}  # name -> W_prev, "update" mode only

    def capture(self, step: int) -> None:
        """Record V_K of W_t - W0 for every matrix; later steps are projected. Collective when sharded."""
        self.bases = {
            name: record_subspace(self._cumulative_update(name), self.rank, self.sharding.get(name)) for name in self.params
        }
        self.captured_step = step

    def _cumulative_update(self, name: str) -> torch.Tensor:
        """W_t - W0 [out, in] float64 (so rounding loses nothing) of matrix `name`, from its stepped weights."""
        weights = _stepped_weights(self.params[name]).detach()
        return weights.double() - self.initial[name].to(weights.device, torch.float64)

    def _project(self, name: str, g: torch.Tensor) -> torch.Tensor:
        """g V V^T of matrix `name` (this rank's block of it when sharded)."""
        sharding = self.sharding.get(name)
        row_parallel = sharding is not None and sharding.dim == 1
        return project_gradient(g, self.bases[name], sharding.group if row_parallel else None)

    def pre_step(self) -> None:
        """Before optimizer.step(): "gradient" mode projects each gradient in place; "update" saves W_prev."""
        if not self.bases:
            return
        if self.mode == "update":
            self._before = {name: _stepped_weights(param).detach().clone() for name, param in self.params.items()}
            return
        for name, param in self.params.items():
            grad = _grad_of(param)
            if grad is None:
                raise RuntimeError(f"{name}: no gradient to project (neither .main_grad nor .grad is set)")
            grad.copy_(self._project(name, grad))
        self.projected_steps += 1

    def post_step(self) -> None:
        """After optimizer.step(): "update" mode replaces each step W - W_prev by (W - W_prev) V V^T, in
        the stepped weights and (when those are a master copy) the parameter."""
        if not self.bases or self.mode != "update":
            return
        with torch.no_grad():
            for name, param in self.params.items():
                weights, before = _stepped_weights(param), self._before[name].float()
                weights.copy_(before + self._project(name, weights.float() - before))
                if weights is not param:
                    param.copy_(weights)  # what the next forward reads
        self._before = {}
        self.projected_steps += 1

    def state_dict(self) -> dict:
        """What a resumed run needs: W0, the recorded bases and the counters."""
        return {"initial": self.initial, "bases": self.bases, "captured_step": self.captured_step,
                "projected_steps": self.projected_steps}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` of a run with the same matrices and tensor-parallel layout."""
        for name, param in self.params.items():
            initial, basis = state["initial"].get(name), state["bases"].get(name)
            if initial is None or initial.shape != param.shape or (basis is not None and basis.shape[0] != param.shape[1]):
                raise ValueError(
                    f"subspace state of {name} does not fit its parameter {tuple(param.shape)} (saved W0 "
                    f"{None if initial is None else tuple(initial.shape)}, basis "
                    f"{None if basis is None else tuple(basis.shape)}); resume with the tensor-parallel size it was saved at"
                )
        self.initial, self.bases = dict(state["initial"]), dict(state["bases"])
        self.captured_step, self.projected_steps = state["captured_step"], state["projected_steps"]

    def summary(self) -> dict:
        """What ran, for the run's metrics: mode, K, the capture step and how many steps were projected."""
        return {"mode": self.mode, "k": self.rank, "captured_step": self.captured_step,
                "projected_steps": self.projected_steps, "matrices": len(self.params)}
