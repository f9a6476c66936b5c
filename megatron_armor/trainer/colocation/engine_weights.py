"""Which policy's weights the rollout engines hold, and the pushes that change that.

With one engine shared by both policies (rollout.anchors.engine shared) the actor's and the reference's weights take
turns in it; each `Policy.holds_weights` says whether the engine holds that policy's current weights: the actor's
after every push of them (engines start with them), both right after a reference reset (the reference is then the
actor), the reference's after an anchor phase. Every rank makes the same calls, so it is the same on all ranks.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from megatron_armor.distributed.reduce import sum_over_ranks
from megatron_armor.rollout.base import RolloutEngine
from megatron_armor.rollout.weight_sync import SyncReport, sync_weights
from megatron_armor.trainer.colocation.colocation import Colocation
from megatron_armor.trainer.step_inputs.policies import Policy, PolicyHandles


class EngineWeights:
    """Pushes of a policy's weights into its engine (collective), and what an engine shared by policies holds."""

    def __init__(self, models: PolicyHandles, colocation: Colocation) -> None:
        self.models, self.colocation = models, colocation

    def push(self, policy: Policy) -> SyncReport:
        """Push `policy`'s current weights (TP- and PP-gathered, HF-named) into its engine, which then holds its
        weights and no longer those of the policies it serves besides."""
        engine = policy.engine
        with self.colocation.weights_resident(policy.name):
            report = push_weights(engine, policy.hf_weights(self.models.shape))
        if self.colocation.offloaded:  # the push's staging buffers leave the GPU with the weights
            engine.release_transfer_buffers()
        for other in self.models.sharing_engine(policy):
            other.holds_weights = other is policy
        return report

    def push_actor(self) -> SyncReport:
        """Push the actor's weights into its engine."""
        return self.push(self.models.actor)

    def load(self, policy: Policy) -> SyncReport | None:
        """Push `policy`'s weights unless its engine holds them (only an engine shared by two policies may not);
        None when it does."""
        return None if policy.holds_weights else self.push(policy)

    def reference_changed(self, *, to_actor: bool) -> None:
        """After the reference's weights changed (`to_actor`: they are now the actor's): a separate reference engine
        gets them; a shared engine holds them only when they are the actor's and it holds the actor's (else it loads
        them before its next anchor phase)."""
        ref, actor = self.models.ref, self.models.actor
        if self.models.shared_engine:
            ref.holds_weights = to_actor and actor.holds_weights
        else:
            self.push(ref)


def push_weights(engine: RolloutEngine, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> SyncReport:
    """Collective: every rank runs the gather (each holds every full tensor) and sends it to the servers its
    engine pushes to (`pushes_weights`); a shared engine's servers are all served once every rank agreed on the
    servers it missed (`retire_servers_any_rank_missed`).

    Returns this rank's measurement (bytes and seconds, the TP/PP gather included).
    """
    report = sync_weights(engine, named_tensors, send=engine.pushes_weights)
    if engine.shared_across_ranks:
        retire_servers_any_rank_missed(engine)
    return report


def retire_servers_any_rank_missed(engine: RolloutEngine) -> None:
    """Collective (after a push to a shared engine; it also orders the ranks as a barrier would): every rank's engine
    stops generating on the servers a push missed on any rank (a dead server; one back up serves again once a push
    reached it). Raises when no server got the push."""
    urls = engine.urls
    missed = engine.missed_push()
    counts = sum_over_ranks([int(url in missed) for url in urls])
    retired = {url for url, count in zip(urls, counts) if count}
    if urls and retired == set(urls):
        raise RuntimeError(f"the weight push reached none of the rollout servers ({', '.join(urls)}): they are down")
    engine.retire_servers(retired)
