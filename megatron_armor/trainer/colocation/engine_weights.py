"""Which policy's weights the rollout engines hold, and the pushes that change that.

With one engine shared by both policies (rollout.anchors.engine shared) the actor's and the reference's
weights take turns in it; `EngineWeights.holds` names the policies whose current weights it holds: the
actor's after every push of them (engines start with them),
both right after a reference reset (the reference is then the actor), the reference's after an anchor
phase. Every rank makes the same calls, so it is the same on all ranks.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from megatron_armor.convert.weights import gather_all_stages_hf_weights
from megatron_armor.distributed.reduce import sum_over_ranks
from megatron_armor.rollout.base import RolloutEngine
from megatron_armor.rollout.weight_sync import SyncReport, sync_weights
from megatron_armor.trainer.colocation.colocation import Colocation
from megatron_armor.trainer.step_inputs.policies import PolicyHandles


class EngineWeights:
    """Pushes of the actor's and the reference's weights into their engines (collective), and what a
    shared engine holds."""

    def __init__(self, models: PolicyHandles, colocation: Colocation) -> None:
        self.models, self.colocation = models, colocation
        self.holds: set[str] = {"actor"}  # "actor" / "ref": meaningful for a shared engine only

    def push(self, policy: str) -> SyncReport:
        """Push `policy`'s ("actor" | "ref") current weights (TP- and PP-gathered, HF-named) into its engine."""
        models = self.models
        if policy == "actor":
            engine, module = models.actor_engine, models.actor.module
        else:
            engine, module = models.ref_engine, models.ref
        with self.colocation.weights_resident(policy):
            report = push_weights(engine, gather_all_stages_hf_weights(module, models.shape))
        if self.colocation.offloaded:  # the push's staging buffers leave the GPU with the weights
            engine.release_transfer_buffers()
        if models.shared_engine:
            self.holds = {policy}
        return report

    def push_actor(self) -> SyncReport:
        """Push the actor's weights into the on-policy engine."""
        return self.push("actor")

    def push_ref(self) -> SyncReport:
        """Push the reference's weights into the anchor engine."""
        return self.push("ref")

    def load_into_shared_engine(self, policy: str) -> SyncReport | None:
        """With one shared engine, push `policy`'s weights ("actor" | "ref") unless it holds them; else None."""
        if not self.models.shared_engine or policy in self.holds:
            return None
        return self.push(policy)

    def phase_order(self, *, uses_anchors: bool) -> tuple[str, ...]:
        """Policies to sample in a generation batch: the actor, and the reference for ARMOR's anchors.

        A shared engine samples first with the weights it holds, so a batch swaps them at most once:
        with one generation batch per step that is one reference push per step, the actor's weights
        being pushed after the update anyway.
        """
        if not uses_anchors:
            return ("actor",)
        return ("ref", "actor") if "actor" not in self.holds else ("actor", "ref")

    def reference_became_actor(self) -> None:
        """After a reference reset: a separate anchor engine gets the new reference's weights; a shared
        engine holding the actor's needs no push (it holds both now)."""
        if not self.models.shared_engine:
            self.push_ref()
        else:
            self.holds = {"actor", "ref"} if "actor" in self.holds else set()


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
