"""`Policy`: one policy of the run as a trainer rank holds it; `PolicyHandles`: the rank's three of them.

Actor, reference and OPD teacher are each a `Policy`: its Megatron model, the rollout engine that samples it,
whether that engine holds its current weights, how it scores a batch and how it is checkpointed. The trainer asks a
policy for these, never its name: the name is data (its entry in a checkpoint's modules, its offload slot, the tag
of its sampling seeds) and the key an algorithm names it by (`algorithms.ACTOR` / `REFERENCE` / `TEACHER`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megatron_armor.convert.weights import gather_all_stages_hf_weights
from megatron_armor.models.hf_config import ModelShape
from megatron_armor.models.lora import adapter_entries
from megatron_armor.rollout.base import RolloutEngine
from megatron_armor.scoring.batch import SequenceBatch
from megatron_armor.scoring.logprobs import ScoringConfig, compute_logprobs
from megatron_armor.scoring.micro_batches import MicroBatching
from megatron_armor.teacher.scorer import TeacherScorer


@dataclass(eq=False)
class Policy:
    """One policy: `model` (a Megatron GPTModel, the actor's DDP-wrapped; None when it lives in a scoring server
    only), `engine` (the rollout engine that samples it; None: it samples nothing), `scorer` (what scores a batch
    under it when that is not `model`'s own forward: the OPD teacher's, in-process or a server),
    `checkpoint_prefix` (its tensors' key prefix in a checkpoint's sharded state, "" for the actor's) and
    `holds_weights` (its engine holds its current weights: engines start with them, and one engine shared by two
    policies holds one's at a time; `colocation.EngineWeights` keeps it, the same on every rank).
    `view` is the context `model` computes this policy in (scores, exported weights): as it is by default; the
    reference of a LoRA run is the actor's model with its adapters off (`models.lora.adapters_disabled`).
    `weights` gives what a push sends its engine from `module` (collective): every stage's weights, HF-named, by
    default; a LoRA actor's adapters alone, PEFT-named, under model.lora.weight_sync adapter.
    `adapters_only`: its checkpointed state is its LoRA adapters alone (the actor of a LoRA run: the frozen base is
    model.path's, named by the checkpoint's `LoRABase`)."""

    name: str
    model: torch.nn.Module | None
    engine: RolloutEngine | None = None
    scorer: TeacherScorer | None = None
    checkpoint_prefix: str = ""
    holds_weights: bool = True
    view: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    weights: Callable[[torch.nn.Module, ModelShape], Iterable[tuple[str, torch.Tensor]]] = gather_all_stages_hf_weights
    adapters_only: bool = False

    @property
    def module(self) -> torch.nn.Module:
        """The bare GPTModel (the actor's, inside its DDP wrapper)."""
        return getattr(self.model, "module", self.model)

    def hf_weights(self, shape: ModelShape) -> Iterator[tuple[str, torch.Tensor]]:
        """Its current weights, TP- and PP-gathered and HF-named (`weights`): what a push sends its engine
        (collective)."""
        with self.view():
            yield from self.weights(self.module, shape)

    def state_dict(self) -> dict[str, Any]:
        """Its model's state dict (the actor's DDP-wrapped: Megatron's keys, no prefix)."""
        return self.model.state_dict()

    def sharded_state_dict(self, prefix: str | None = None) -> dict[str, Any]:
        """Its model's Megatron sharded state dict (`adapters_only`: its adapters' entries alone), tensors under their
        global keys behind `prefix` (default its `checkpoint_prefix`; another policy's, to load that policy's saved
        weights into this one's tensors)."""
        state = self.module.sharded_state_dict(prefix=self.checkpoint_prefix if prefix is None else prefix)
        return adapter_entries(state) if self.adapters_only else state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load `state` (a `state_dict()`, or a loaded `sharded_state_dict()`: its keys lose `checkpoint_prefix`).
        `adapters_only`: `state` must hold every adapter tensor and nothing unknown, and the base keeps its weights
        where `state` has none of them; ValueError otherwise."""
        prefix = self.checkpoint_prefix
        state = {key.removeprefix(prefix): value for key, value in state.items()}
        if not self.adapters_only:
            self.model.load_state_dict(state)
            return
        result = self.module.load_state_dict(state, strict=False)
        missing = sorted(adapter_entries(dict.fromkeys(result.missing_keys)))
        if missing or result.unexpected_keys:
            raise ValueError(f"the {self.name}'s adapter state lacks {missing[:3]} and has unknown entries "
                             f"{sorted(result.unexpected_keys)[:3]}: it was saved with another model.lora")

    def score(self, batch: SequenceBatch, *, micro_batching: MicroBatching, scoring: ScoringConfig) -> torch.Tensor:
        """[B, S] float32 label-aligned logprobs of `batch` under this policy, 0 off the response (collective over the
        model-parallel group): its `scorer`'s, else its model's forward in `micro_batching` micro-batches."""
        if self.scorer is not None:
            return self.scorer.score(batch)
        with self.view():
            return compute_logprobs(self.model, batch, micro_batching=micro_batching, scoring=scoring).logprobs


@dataclass
class PolicyHandles:
    """The policies of one rank: the trainable `actor` (its model DDP-wrapped, stepped by `optimizer`), the frozen
    `ref`erence and, for OPD, the frozen `teacher`; the actor's `shape` (the reference's too) and the pad token.

    The OPD teacher's engine (opd.rollouts teacher) samples the training responses in place of the actor's; it holds
    the teacher's weights and is never synced. The actor's engine still serves validation and receives the actor's
    weights after every update.
    """

    actor: Policy
    ref: Policy
    optimizer: object  # MegatronOptimizer
    shape: ModelShape
    pad_token_id: int
    teacher: Policy | None = None

    def __post_init__(self) -> None:
        """An engine shared by policies starts with the first's weights (the actor's): engines start with them."""
        for policy in self.policies():
            policy.holds_weights = self.sharing_engine(policy)[0] is policy

    def policies(self) -> list[Policy]:
        """Every policy of the rank: actor, reference (and teacher)."""
        return [policy for policy in (self.actor, self.ref, self.teacher) if policy is not None]

    def policy(self, name: str) -> Policy:
        """The policy an algorithm names `name` (`ACTOR`, `REFERENCE`, `TEACHER`); KeyError when the rank has none."""
        found = {policy.name: policy for policy in self.policies()}
        if name not in found:
            raise KeyError(f"no {name!r} policy on this rank (has {sorted(found)})")
        return found[name]

    def sharing_engine(self, policy: Policy) -> list[Policy]:
        """The policies whose engine is `policy`'s (itself included; only itself without an engine)."""
        if policy.engine is None:
            return [policy]
        return [other for other in self.policies() if other.engine is policy.engine]

    @property
    def shared_engine(self) -> bool:
        """One engine serves actor and reference (rollout.anchors.engine shared); their weights take turns in it."""
        return self.ref.engine is self.actor.engine

    def engines(self) -> list[RolloutEngine]:
        """Every distinct engine of the rank (a shared engine once), e.g. to close them."""
        engines = (policy.engine for policy in self.policies())
        return list({id(e): e for e in engines if e is not None}.values())

