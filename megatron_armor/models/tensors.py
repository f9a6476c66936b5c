"""A module's checkpoint tensors: its parameters and its persistent buffers (a MoE router's expert-bias correction
term is a buffer both in Megatron, `TopKRouter.expert_bias`, and in transformers, `e_score_correction_bias`), the
tensors conversion, the weight export and the engine's weight push move; `named_parameters()` alone misses the
buffers."""

from __future__ import annotations

import torch


def checkpoint_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name -> tensor of `module`'s parameters, then its persistent buffers (what its `state_dict` holds, without
    extra state), by their qualified names."""
    tensors: dict[str, torch.Tensor] = dict(module.named_parameters())
    for prefix, child in module.named_modules():
        tensors.update({f"{prefix}.{name}" if prefix else name: buffer
                        for name, buffer in child.named_buffers(recurse=False)
                        if name not in child._non_persistent_buffers_set})
    return tensors
