"""Routing replay on Megatron's MoE routers: route a forward's tokens to given experts, and record the routers' own
choice.

Megatron-Core 0.19 routes through one hook: `TopKRouter.router_replay`, an object whose
`get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)` returns the top-k (probabilities,
indices) `topk_routing_with_score_function` goes on with. This module puts a `RouterTap` there on each router
(no Megatron code is changed). Megatron's own `RouterReplay` is not used: it registers every router of every model
in one process-wide list, and replays a whole tensor or nothing, while a replayed forward here must fall back to
the router's own choice at positions without a record (padding, the last token of a sequence, which no engine
feeds).

Gradients flow as without replay: the probabilities of the replayed experts are gathered from the router's own
scores (its logits, or their softmax), so the router's weights get the gradient of the replayed routing (as slime
and verl replay).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from megatron.core.transformer.moe.router import TopKRouter

TopK = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class RouterTap:
    """The `router_replay` of one router (global decoder layer `layer`, 0-based).

    target: [N, k] int64 experts to route the next forward's N tokens to (router token order), -1 where the router
      chooses itself; None: the router chooses everywhere.
    chosen: [N, k] int64 the router's own top-k of its last forward (whatever was replayed), detached.
    applied: [N, k] int64 the experts its last forward routed to.
    """

    def __init__(self, layer: int) -> None:
        self.layer = layer
        self.target: torch.Tensor | None = None
        self.chosen: torch.Tensor | None = None
        self.applied: torch.Tensor | None = None

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None, group_topk: int | None,
                        default_compute_topk: TopK) -> tuple[torch.Tensor, torch.Tensor]:
        """Megatron's hook: scores [N, E] -> (probabilities or scores of the routed experts [N, k], indices [N, k])."""
        probs, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        self.chosen = indices.detach()
        if self.target is not None:
            if self.target.shape != indices.shape:
                raise ValueError(f"routing replay, layer {self.layer}: {tuple(self.target.shape)} recorded routes for "
                                 f"a forward whose router sees {tuple(indices.shape)} (tokens, top-k)")
            target = self.target.to(indices.device)
            indices = torch.where(target >= 0, target, indices)
            probs = scores.gather(1, indices)
        self.applied = indices.detach()
        return probs, indices


class RoutingTaps:
    """The `RouterTap`s of a model's routers on this pipeline stage, in layer order. Routes cross this class as
    [N, L, k] tensors in router token order (a forward's [s, b] positions flattened s-major, as Megatron's router
    sees them) over all L decoder layers of the model; columns of layers without a router here (dense layers, other
    pipeline stages) are ignored on the way in and -1 on the way out."""

    def __init__(self, taps: list[RouterTap]) -> None:
        self.taps = taps

    @classmethod
    def of(cls, model: torch.nn.Module) -> RoutingTaps:
        """The taps of `model`'s routers (a GPTModel or a wrapper of one), put on them the first time."""
        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        for router in routers:
            if not isinstance(router.router_replay, RouterTap):
                router.router_replay = RouterTap(router.layer_number - 1)  # Megatron's global, 1-based number
        return cls([router.router_replay for router in routers])

    def set_targets(self, routes: torch.Tensor | None) -> None:
        """Replay `routes` [N, L, k] (int, -1: the router chooses) in the next forward; None: no replay."""
        for tap in self.taps:
            tap.target = None if routes is None else routes[:, tap.layer].long()

    def take(self, num_layers: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(chosen, applied) [N, num_layers, k] int64 of the last forward, and forget them and the targets; None
        when no router of this stage ran."""
        if not self.taps or self.taps[0].chosen is None:
            return None
        first = self.taps[0].chosen
        chosen, applied = (first.new_full((first.shape[0], num_layers, first.shape[1]), -1) for _ in range(2))
        for tap in self.taps:
            chosen[:, tap.layer], applied[:, tap.layer] = tap.chosen, tap.applied
            tap.chosen = tap.applied = tap.target = None
        return chosen, applied
