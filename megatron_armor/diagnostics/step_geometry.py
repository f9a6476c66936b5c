"""Per-step update geometry of the actor's decoder matrices, per layer type (cheap enough to log every few steps).

For each type of 2-D decoder weight as Megatron holds it (`linear_qkv`: fused q/k/v, `linear_proj`: attention output,
`linear_fc1`: fused gate/up, `linear_fc2`: down), over all layers:
- relative update  ||W_after - W_before||_F / ||W_before||_F  of the RL step (all its optimizer steps);
- changed fraction: entries that changed under the bf16-aware rule of `geometry.unchanged_mask` (opd.md §2.1);
- reference drift  ||W - W_ref||_F / ||W_ref||_F  from the reference policy's weights (ARMOR's anchor).
Norms are of the whole matrices: each rank sums squares over its shards and the sums are all-reduced over the
model-parallel (TP x PP) group, a MoE model's experts' over the expert (expert-TP x EP x PP) group, so every rank
logs the same values. It costs one copy of the decoder matrices
(`StepGeometry.capture`, on their device) and a few elementwise passes over them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_armor.diagnostics.geometry import unchanged_mask

DECODER_MATRICES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
SUMS = ("update_sq", "before_sq", "changed", "entries", "drift_sq", "ref_sq")  # per layer type, in this order


def decoder_matrices(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name -> this rank's shard of every 2-D decoder weight of a `DECODER_MATRICES` type."""
    return {name: param for name, param in module.named_parameters()
            if param.dim() == 2 and name.startswith("decoder.") and name.split(".")[-2] in DECODER_MATRICES}


@dataclass
class StepGeometry:
    """The actor's decoder matrices before an RL step's update (`capture`), to measure the step by (`metrics`)."""

    before: dict[str, torch.Tensor]  # name -> detached copy of this rank's shard
    capture_seconds: float = 0.0

    @classmethod
    def capture(cls, actor: torch.nn.Module) -> StepGeometry:
        start = time.perf_counter()
        before = {name: param.detach().clone() for name, param in decoder_matrices(actor).items()}
        return cls(before, time.perf_counter() - start)

    @torch.no_grad()
    def metrics(self, actor: torch.nn.Module, reference: torch.nn.Module) -> dict[str, float]:
        """{"geometry/<type>_rel_update", "..._changed_fraction", "..._ref_drift"} of the step since `capture`
        (collective over the model-parallel group)."""
        after, ref = decoder_matrices(actor), decoder_matrices(reference)
        sums = torch.zeros(2, len(DECODER_MATRICES), len(SUMS), dtype=torch.float64)  # [shared | experts, ...]
        for name, weight in after.items():
            row = sums[int(".local_experts." in name), DECODER_MATRICES.index(name.split(".")[-2])]
            before, anchor = self.before[name], ref[name]
            row += torch.tensor([
                _squared_norm(weight - before), _squared_norm(before),
                float((~unchanged_mask(before, weight)).sum()), float(weight.numel()),
                _squared_norm(weight - anchor), _squared_norm(anchor),
            ], dtype=torch.float64)
        if dist.is_initialized() and parallel_state.model_parallel_is_initialized():
            has_experts = bool(getattr(getattr(actor, "config", None), "num_moe_experts", None))
            groups = [parallel_state.get_model_parallel_group()] + (
                [parallel_state.get_expert_tensor_model_pipeline_parallel_group()] if has_experts else [])
            device = _collective_device(after)
            sums = torch.stack([_all_reduced(part, group, device) for part, group in zip(sums, groups)])
        return _ratios(sums.sum(0))


def _all_reduced(sums: torch.Tensor, group, device: torch.device) -> torch.Tensor:
    """`sums` summed over `group`, through `device` (where the collective runs), back on the CPU."""
    on_device = sums.to(device)
    dist.all_reduce(on_device, group=group)
    return on_device.cpu()


def _squared_norm(tensor: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(tensor, dtype=torch.float64) ** 2)


def _collective_device(weights: dict[str, torch.Tensor]) -> torch.device:
    """Where the collective runs: the weights' device (CPU under gloo, the GPU under NCCL)."""
    return next(iter(weights.values())).device if weights else torch.device("cpu")


def _ratios(sums: torch.Tensor) -> dict[str, float]:
    """Per layer type [types, SUMS] sums -> the logged ratios (types without weights on any rank are left out)."""
    metrics = {}
    for kind, (update_sq, before_sq, changed, entries, drift_sq, ref_sq) in zip(DECODER_MATRICES, sums.tolist()):
        if not entries:
            continue
        metrics[f"geometry/{kind}_rel_update"] = math.sqrt(update_sq / before_sq) if before_sq else math.nan
        metrics[f"geometry/{kind}_changed_fraction"] = changed / entries
        metrics[f"geometry/{kind}_ref_drift"] = math.sqrt(drift_sq / ref_sq) if ref_sq else math.nan
    return metrics
