"""Expert routes of a batch's tokens through the MoE routers of a pass over its micro-batches.

Routes are kept per batch row as `SequenceBatch.routed_experts` [B, S, L, k] (position t: the experts token
input_ids[t] goes to in decoder layer l, -1: none recorded; L counts every decoder layer, as SGLang's
`routed_experts` does). A `RoutingPass` is what one pass (`scoring.logprobs.forward_backward`) does with them: for each
micro-batch it puts the rows' routes (if the batch has them) on the model's routers to replay (`models.routing_replay`), and afterwards reads
back what the routers chose themselves, into a [B, S, L, k] table of the pass (`chosen`, the routing an R2 update
replays) and into `RoutingCounts` (the `moe/*` routing metrics).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_attr_wrapped_model

from megatron_armor.distributed.reduce import sum_over_ranks
from megatron_armor.models.routing_replay import RoutingTaps
from megatron_armor.scoring.batch import SequenceBatch
from megatron_armor.scoring.context_split import RankShare
from megatron_armor.scoring.micro_batches import MicroBatch

NO_ROUTE = -1


def router_order(routes: torch.Tensor, mb: MicroBatch, share: RankShare | None = None) -> torch.Tensor:
    """A micro-batch's row routes [n, s, L, k] as its routers see its tokens: [s * n, L, k] (Megatron's [s, n]
    layout, flattened), or packed [T, L, k] (the tail past its real tokens: NO_ROUTE); under context parallelism
    this CP rank's `share` of them (its padding: NO_ROUTE)."""
    if mb.packed is None:
        tokens = routes
    else:  # [1, T, L, k]
        tokens = routes.new_full((1, mb.packed.input_ids.shape[1], *routes.shape[2:]), NO_ROUTE)
        rows, columns = mb.packed.token_rows.to(routes.device), mb.packed.token_columns.to(routes.device)
        tokens[0, : rows.numel()] = routes[rows, columns]
    if share is not None:
        tokens = share.tokens.split(tokens, NO_ROUTE)
    return tokens.transpose(0, 1).reshape(-1, *routes.shape[2:])


def row_order(flat: torch.Tensor, mb: MicroBatch, share: RankShare | None = None) -> torch.Tensor:
    """The inverse of `router_order`: routes [N, L, k] of the routers' tokens (under context parallelism this CP
    rank's `share`, gathered from every CP rank) as rows [n, s, L, k] of the micro-batch (NO_ROUTE at packed rows'
    padding)."""
    n, s = mb.rows.input_ids.shape
    tokens = flat.view(-1, 1 if mb.packed is not None else n, *flat.shape[1:]).transpose(0, 1)  # [b, s', L, k]
    if share is not None:
        tokens = share.tokens.gather(tokens)
    if mb.packed is None:
        return tokens
    rows = flat.new_full((n, s, *flat.shape[1:]), NO_ROUTE)
    real = mb.packed.token_rows.numel()
    rows[mb.packed.token_rows.to(flat.device), mb.packed.token_columns.to(flat.device)] = tokens[0, :real]
    return rows


def real_positions(mb: MicroBatch) -> torch.Tensor:
    """[n, s] bool: the positions of the micro-batch's rows that hold a token (not padding)."""
    n, s = mb.rows.input_ids.shape
    return torch.arange(s, device=mb.rows.input_ids.device)[None, :] < mb.rows.real_lengths().to(
        mb.rows.input_ids.device)[:, None]


@dataclass
class RoutingCounts:
    """Routing facts of a pass, summed over its tokens (real positions only) and routed layers.

    load: [L, E] int64 tokens sent to each expert of each layer (the routing the forward used);
    agreed / compared: token-layer routes where the router's own top-k is, as a set, the replayed one, of those
    with a replayed route; applied: those where the forward sent the token to the replayed experts.
    """

    load: torch.Tensor
    agreed: int = 0
    compared: int = 0
    applied: int = 0

    def add(self, chosen: torch.Tensor, applied: torch.Tensor, target: torch.Tensor | None, real: torch.Tensor) -> None:
        """Count one micro-batch: chosen / applied / target [n, s, L, k] (NO_ROUTE: none), real [n, s] bool."""
        routed = (applied >= 0).all(-1) & real[:, :, None]  # [n, s, L]: a token through a router here
        experts = applied[routed]  # [R, k]
        layers = torch.nonzero(routed)[:, 2, None].expand_as(experts)
        self.load.view(-1).index_add_(0, (layers * self.load.shape[1] + experts).reshape(-1).cpu(),
                                      torch.ones(experts.numel(), dtype=torch.int64))
        if target is not None:
            replayed = routed & (target >= 0).all(-1)
            target_set = target.sort(-1).values
            same = (chosen.sort(-1).values == target_set).all(-1)
            self.agreed += int((same & replayed).sum())
            self.compared += int(replayed.sum())
            self.applied += int(((applied.sort(-1).values == target_set).all(-1) & replayed).sum())

    def metrics(self, *, agreement: bool) -> dict[str, float]:
        """{"moe/expert_load_cv": std / mean of the tokens per expert, averaged over the routed layers, and with
        `agreement` "moe/routing_agreement": agreed / compared (how far the trainer's router is from the engine's:
        below 1 wherever they would route apart) and "moe/replay_applied": applied / compared (1 when the replay took
        effect in every routed layer and micro-batch)}, over every rank's tokens (collective over all ranks;
        data-parallel ranks hold other tokens, pipeline stages other layers; the scale tensor-parallel copies add
        changes no ratio)."""
        summed = sum_over_ranks([*self.load.reshape(-1).tolist(), self.agreed, self.applied, self.compared])
        agreed, applied, compared = summed[-3:]
        load = torch.tensor(summed[:-3], dtype=torch.float64).view_as(self.load)
        load = load[load.sum(1) > 0]  # the routed layers
        cv = load.std(1, unbiased=False) / load.mean(1)
        metrics = {"moe/expert_load_cv": float(cv.mean()) if len(load) else 0.0}
        if agreement:
            metrics["moe/routing_agreement"] = agreed / max(compared, 1)
            metrics["moe/replay_applied"] = applied / max(compared, 1)
        return metrics


@dataclass(frozen=True)
class ReplayMode:
    """What a `train.routing_replay` choice asks of the engines and of the actor's passes (`REPLAY_MODES`)."""

    engines_record: bool  # rollouts carry the engine's routes; the old-logprob pass and the update replay them (R3)
    update_replays_old_pass: bool  # the update replays the routers' own choices of the old-logprob pass (R2)


REPLAY_MODES = {
    "none": ReplayMode(engines_record=False, update_replays_old_pass=False),
    "rollout": ReplayMode(engines_record=True, update_replays_old_pass=False),
    "recompute": ReplayMode(engines_record=False, update_replays_old_pass=True),
}


@dataclass
class RoutingPass:
    """What one pass over a batch of B rows, S columns does with the routers of a model (`taps`; `config` its
    TransformerConfig: L decoder layers, E experts, top-k): replay each micro-batch's `routed_experts` (when it has them), and
    keep what the routers chose (`chosen`: [B, S, L, k] int16, the layers routed on this pipeline stage; NO_ROUTE
    elsewhere) and the pass's `counts`. Under sequence parallelism a router sees its tensor-parallel rank's slice of
    the [s, b] positions: it gets that slice's routes, and what the ranks chose is gathered back."""

    taps: RoutingTaps
    config: TransformerConfig
    batch_shape: tuple[int, int]
    chosen: torch.Tensor = field(init=False)
    counts: RoutingCounts = field(init=False)
    replayed: bool = field(init=False, default=False)  # some micro-batch had routes to replay

    def __post_init__(self) -> None:
        layers, top_k = self.config.num_layers, self.config.moe_router_topk
        self.chosen = torch.full((*self.batch_shape, layers, top_k), NO_ROUTE, dtype=torch.int16)
        self.counts = RoutingCounts(torch.zeros(layers, self.config.num_moe_experts, dtype=torch.int64))

    def before(self, mb: MicroBatch, share: RankShare | None = None) -> None:
        """Put the micro-batch's routes (on its device; under context parallelism this CP rank's `share` of them) on
        the routers, or none."""
        routes = mb.rows.routed_experts
        if routes is not None:
            self.replayed = True
            routes = router_order(routes, mb, share)
            if self.config.sequence_parallel:
                group = parallel_state.get_tensor_model_parallel_group()
                routes = routes.chunk(dist.get_world_size(group))[dist.get_rank(group)]
        self.taps.set_targets(routes)

    def after(self, mb: MicroBatch, share: RankShare | None = None) -> None:
        """Read the routers' choices of the micro-batch's forward (under context parallelism of this CP rank's
        `share`, gathered from every CP rank) into `chosen` and `counts`."""
        taken = self.taps.take(self.config.num_layers)
        if taken is None:
            return
        if self.config.sequence_parallel:
            taken = tuple(_gather_sequence(flat) for flat in taken)
        chosen, applied = (row_order(flat, mb, share).cpu() for flat in taken)
        target = None if mb.rows.routed_experts is None else mb.rows.routed_experts.cpu()
        self.counts.add(chosen, applied, target, real_positions(mb).cpu())
        self.chosen[mb.row_index, : chosen.shape[1]] = chosen.to(torch.int16)

    def metrics(self) -> dict[str, float]:
        """The pass's `moe/*` routing metrics (`RoutingCounts.metrics`; the agreement when it replayed routes, which
        every rank's batch has or none has). Collective over all ranks."""
        return self.counts.metrics(agreement=self.replayed)


def _gather_sequence(flat: torch.Tensor) -> torch.Tensor:
    """Every tensor-parallel rank's [N/tp, ...] slice, concatenated in rank order: [N, ...]."""
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, flat.contiguous(), group=group)
    return torch.cat(parts)


def routing_pass(model: torch.nn.Module, batch: SequenceBatch) -> RoutingPass | None:
    """A `RoutingPass` of `model` (a GPTModel, or a wrapper of one) over `batch`, replaying its `routed_experts`;
    None for a dense model."""
    config = get_attr_wrapped_model(model, "config")
    if not config.num_moe_experts:
        return None
    return RoutingPass(RoutingTaps.of(model), config, tuple(batch.input_ids.shape))
