"""The experts an in-process HF MoE model routes its tokens to, read from its routers by forward hooks.

transformers 5's Qwen3-MoE and Qwen2-MoE routers (`Qwen3MoeTopKRouter`, `Qwen2MoeTopKRouter`: a decoder layer's
`mlp.gate`) return (logits, top-k weights, top-k indices [tokens, k]) for the layer's [batch * tokens] flattened
hidden states; the hook keeps the indices of the last forward.
"""

from __future__ import annotations

import torch


class RouteCapture:
    """Hooks on the routers of `model`'s decoder layers; `take` gives the last forward's routes [B, T, L, k] int32
    (L: every decoder layer, 0 in layers without a router, as SGLang fills its buffer)."""

    def __init__(self, model: torch.nn.Module) -> None:
        layers = model.get_decoder().layers
        self.num_layers = len(layers)
        self.top_k = model.config.num_experts_per_tok
        self._last: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(layers):
            gate = getattr(getattr(layer, "mlp", None), "gate", None)
            if gate is not None and hasattr(gate, "top_k"):  # a routed layer (dense layers' mlp has no gate)
                gate.register_forward_hook(self._keep(index))

    def _keep(self, index: int):
        def hook(module, inputs, output):
            self._last[index] = output[2]  # [B * T, k] top-k expert indices

        return hook

    def take(self, batch: int, tokens: int) -> torch.Tensor:
        """The last forward's routes of its [batch, tokens] inputs: [batch, tokens, L, k] int32 (then forgotten)."""
        device = next(iter(self._last.values())).device
        routes = torch.zeros(batch, tokens, self.num_layers, self.top_k, dtype=torch.int32, device=device)
        for index, indices in self._last.items():
            routes[:, :, index] = indices.view(batch, tokens, -1)
        self._last.clear()
        return routes
