"""Metrics of a mixture-of-experts policy's update: the router's load-balancing auxiliary loss."""

from __future__ import annotations

from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.transformer_config import TransformerConfig

# model.moe_load_balancing -> the name Megatron's router records its (coefficient-free) auxiliary loss under.
_TRACKED_LOSS = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}


def moe_aux_loss_metrics(config: TransformerConfig, micro_batches: int) -> dict[str, float]:
    """{"moe/aux_loss": the load-balancing loss before its coefficient, mean over MoE layers and the
    `micro_batches` micro-batches of the update (averaged over data-parallel ranks, summed over pipeline
    stages' layers by Megatron's tracker, which this resets)}; {} for a dense model or with the loss off
    (coefficient 0). Routers record it only in training forwards with gradients. Collective over all ranks."""
    name = _TRACKED_LOSS.get(config.moe_router_load_balancing_type) if config.num_moe_experts else None
    if name is None or config.moe_aux_loss_coeff == 0:
        return {}
    scalars: dict = {}
    get_moe_metrics_tracker().report(
        loss_scale=1.0 / max(micro_batches, 1), iteration=0, force_initialize=True, track_names=[name],
        num_layers=config.num_layers, moe_layer_freq=config.moe_layer_freq, total_loss_dict=scalars,
    )
    return {"moe/aux_loss": float(scalars[name])}
