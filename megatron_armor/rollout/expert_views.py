"""HF checkpoint names for an in-memory transformers model whose MoE experts are fused.

transformers 5 holds a Qwen3-MoE layer's experts as two stacked tensors, `mlp.experts.gate_up_proj`
[E, 2 * I, H] (each expert's gate rows, then its up rows) and `mlp.experts.down_proj` [E, H, I], while checkpoints
(and the trainer's weight push, through `convert.mapping`) name one tensor per expert and projection:
`mlp.experts.{e}.gate_proj.weight` [I, H], `up_proj.weight` [I, H], `down_proj.weight` [H, I].
"""

from __future__ import annotations

import torch

_FUSED_GATE_UP, _FUSED_DOWN = ".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"


def checkpoint_named_views(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`params` (name -> in-memory tensor) by checkpoint name: fused expert tensors become per-expert views
    of them (writing into a view writes the fused tensor), every other tensor is itself."""
    views: dict[str, torch.Tensor] = {}
    for name, tensor in params.items():
        if name.endswith(_FUSED_GATE_UP):
            prefix = name.removesuffix(".gate_up_proj")
            for expert, fused in enumerate(tensor):
                gate, up = fused.chunk(2, dim=0)
                views[f"{prefix}.{expert}.gate_proj.weight"], views[f"{prefix}.{expert}.up_proj.weight"] = gate, up
        elif name.endswith(_FUSED_DOWN):
            prefix = name.removesuffix(".down_proj")
            views.update({f"{prefix}.{expert}.down_proj.weight": down for expert, down in enumerate(tensor)})
        else:
            views[name] = tensor
    return views
