"""The RL step, top to bottom: rollout -> advantages -> logprobs -> update -> weight sync (-> MIPU gate,
reference reset), and the trainer state a resumed run needs."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_armor.algorithms import REFERENCE, TEACHER, Algorithm
from megatron_armor.config import OptimizerConfig
from megatron_armor.data.types import Sample
from megatron_armor.diagnostics.step_geometry import StepGeometry
from megatron_armor.diagnostics.subspace import SubspaceConstraint
from megatron_armor.distributed.init import DistributedContext
from megatron_armor.planning.flops import rl_step_flops
from megatron_armor.rollout.pausable import PausableEngine
from megatron_armor.scoring.logprobs import ScoringConfig
from megatron_armor.trainer.checkpointing.sharded_state import (
    OPTIMIZER, restore_module, restore_order, sharded_modules,
)
from megatron_armor.trainer.colocation.colocation import Colocation
from megatron_armor.trainer.colocation.engine_weights import EngineWeights
from megatron_armor.trainer.rollouts import async_rollouts  # noqa: F401 - registers rollout.mode async
from megatron_armor.trainer.rollouts.anchor_cache import AnchorCache
from megatron_armor.trainer.rollouts.anchors import AnchorSource
from megatron_armor.trainer.rollouts.rollout_phase import RolloutPhase, RolloutSources
from megatron_armor.trainer.rollouts.rollout_schedule import RolloutSchedule
from megatron_armor.trainer.step_inputs.plan import StepPlan
from megatron_armor.trainer.step_inputs.policies import Policy, PolicyHandles
from megatron_armor.trainer.update.faults import NonFiniteUpdate
from megatron_armor.trainer.update.optimizer import reset_optimizer
from megatron_armor.trainer.update.policy_update import update_policy
from megatron_armor.trainer.update.snapshot import TrainingSnapshot
from megatron_armor.trainer.update.training_batch import PreparedBatch, advantage_batch, batch_metrics, score_logprobs
from megatron_armor.trainer.update.update_gate import InferenceGapGate

log = logging.getLogger("megatron_armor")


@dataclass
class TrainerParts:
    """The optional parts of an RL step; each is off when None."""

    gate: InferenceGapGate | None = None  # MIPU Step 2: post-update gate with rollback
    constraint: SubspaceConstraint | None = None  # subspace-constrained training ...
    constraint_capture_step: int = 0  # ... whose span is captured after this RL step
    anchor_cache: AnchorCache | None = None  # a prompt's anchors sampled once per reference
    colocation: Colocation = field(default_factory=Colocation)  # GPU phases shared with colocated servers
    geometry_every: int = 0  # log the update's geometry every this many RL steps (0: never)


class RLTrainer:
    """Runs RL steps and holds what a resumed run needs (`state_dict` / `load_state_dict`); owns no I/O
    besides the engines (metrics and checkpoint files are the caller's).

    With a `gate` (MIPU Step 2) every step snapshots the actor first and rolls back actor, optimizer
    and engine when the post-update inference gap is out of tolerance. With an `anchor_cache` a
    prompt's anchors are sampled once per reference (trainer/rollouts/anchor_cache.py). Colocated with its
    servers (`memory_handoff`, `offload`), the trainer and the servers take turns on the GPU
    (trainer/colocation/colocation.py); with one engine shared by both policies their weights take turns in it
    (trainer/colocation/engine_weights.py).

    An update whose loss or gradients are not finite on any rank is skipped as a whole: actor, optimizer
    state and engines keep the state from before the RL step (mini-batches already stepped are undone from
    a snapshot) and `consecutive_skips` counts such steps in a row; the caller decides when to stop.
    """

    def __init__(
        self, ctx: DistributedContext, models: PolicyHandles, plan: StepPlan, sources: RolloutSources,
        scoring: ScoringConfig, optim: OptimizerConfig, parts: TrainerParts | None = None,
    ) -> None:
        parts = parts or TrainerParts()
        self.ctx, self.models, self.plan, self.sampler = ctx, models, plan, sources.sampler
        self.scoring, self.optim = scoring, optim
        self.gate = parts.gate
        self.constraint, self.constraint_capture_step = parts.constraint, parts.constraint_capture_step
        self.colocation, self.geometry_every = parts.colocation, parts.geometry_every
        self.engine_weights = EngineWeights(models, self.colocation)
        # ARMOR's anchors: the rollout source an algorithm may ask for (ARMOR, or a run the anchor action switched)
        self.anchors = AnchorSource(models.ref, plan.rollout.anchors.ref_n, parts.anchor_cache,
                                    engine_weights=self.engine_weights, sampling=sources.sampling,
                                    scorer=sources.scorer, train_seed=plan.train.seed)
        # partial rollouts: the rollout phase samples through an engine a weight push pauses (the schedule's)
        phase_models = (dataclasses.replace(models, actor=dataclasses.replace(
            models.actor, engine=PausableEngine(models.actor.engine))) if plan.rollout.partial_rollouts else models)
        self.rollouts = RolloutSchedule.build(
            plan.rollout.mode, lambda group: RolloutPhase(plan, phase_models, sources, self.engine_weights,
                                                          [self.anchors], dp_size=ctx.dp_size, group=group),
            sources.sampler, plan.train.max_steps,
        )
        self.optimizer_steps = 0
        self.consecutive_skips = 0  # RL steps in a row whose update was skipped for a non-finite loss or gradient
        # the reference leaves model.ref_path's weights (under LoRA it stays the base: a reset resets the adapters)
        self.checkpoints_reference = bool(plan.algorithm_section.ref_reset_period) and not models.actor.adapters_only
        self.warmup_from = 0  # the RL step the lr warmup counts from (the anchor action restarts it)

    # ----- one RL step ---------------------------------------------------------------------
    def step(self, step: int) -> dict[str, float]:
        """Run RL step `step` (0-based) and return its metrics.

        When filtering leaves no prompts (allow_partial_batch) every rank skips the update, the weight
        sync and the gate alike, and `train/update_skipped` is 1. So it is when the update met a non-finite
        loss or gradient (then `train/nonfinite_skipped` is 1 too; the unchanged actor is pushed again).
        """
        start = time.perf_counter()
        self.colocation.park_for_rollouts()                                # the GPU is the servers'
        rollout = self.rollouts.take(step)                                 # generate, score, group (or take ahead)
        metrics = {**rollout.metrics, "perf/rollout_seconds": time.perf_counter() - start}
        num_tokens = 0
        if rollout.groups:                                                 # advantages ... sync, MIPU gate
            update_metrics, num_tokens = self.train_on(step, rollout.groups)
            metrics.update(update_metrics)
        self.rollouts.settle()                                             # nothing generates past the step
        metrics.update(self.rollouts.step_metrics())
        metrics["train/update_skipped"] = float(not rollout.groups or "train/nonfinite_skipped" in metrics)
        metrics.update(self.capture_subspace(step))
        if self.plan.resets_reference_after(step) and not self.models.actor.adapters_only:  # LoRA: AdapterReset
            metrics.update(self.reset_reference())
        metrics.update(self.colocation.offload_metrics())
        seconds = time.perf_counter() - start
        flops = self.step_flops(rollout.groups)
        metrics.update({"perf/step_seconds": seconds, "perf/tokens_per_second": num_tokens / max(seconds, 1e-9),
                        "perf/tflops_per_gpu": flops / max(seconds, 1e-9) / self.ctx.world_size / 1e12 if flops else 0.0})
        return metrics

    def step_flops(self, groups: list[list[Sample]]) -> float:
        """Training FLOPs of an RL step over `groups` (Megatron's formula, planning/flops.py): the update, the
        old-policy logprobs (unless the update gives them) and, as the algorithm needs them, the reference's and the
        teacher's (at the student's shape); rollout generation and the MIPU gate's scoring are not counted. 0 when
        no prompt was kept."""
        if not groups:
            return 0.0
        scores = self.plan.algorithm.sources.scores
        lengths = [len(s.prompt_ids) + len(s.response_ids) for group in groups for s in group]
        return rl_step_flops(self.models.shape, lengths, reference=REFERENCE in scores,
                             teacher=self.models.shape if TEACHER in scores else None,
                             old_logprobs=not self.plan.old_logprobs_from_update).total

    def train_on(self, step: int, groups: list[list[Sample]]) -> tuple[dict[str, float], int]:
        """Update the actor on `groups` at RL step `step`'s learning rate, push it to the engine and (MIPU)
        gate it; returns the metrics and the step's prompt + response token count. Only an update that stays
        applied (not skipped, not rolled back) advances the rollouts' weight version."""
        start = time.perf_counter()
        optimizer_steps_before = self.optimizer_steps
        ctx, models, plan = self.ctx, self.models, self.plan
        with self.colocation.trainer_phase(resume_serving=False):         # the servers release the GPU
            advantaged = advantage_batch(groups, plan, dp_size=ctx.dp_size, dp_rank=ctx.dp_rank,
                                         pad_token_id=models.pad_token_id)
            prepared = score_logprobs(advantaged, models, plan, self.scoring, optimizer_steps=self.optimizer_steps,
                                      dp_rank=ctx.dp_rank)
            snapshot = self.snapshot_before_update(len(prepared.mini_batches))
            geometry = StepGeometry.capture(models.actor.module) if self.measures_geometry(step) else None
            update_metrics, fault = self.update(step, prepared, snapshot)
            metrics = batch_metrics(prepared, plan.algorithm.sources)  # of the batch before the update
            metrics.update(update_metrics)
            if geometry is not None and fault is None:
                metrics.update(self.update_geometry(geometry))
        metrics["perf/train_seconds"] = time.perf_counter() - start
        self.rollouts.settle()  # the next step's rollout, generated ahead, is done with the weights to replace
        gated = self.gate is not None and fault is None
        sync = self.colocation.push_actor_and_serve(self.engine_weights.push_actor, keep_weights=gated)
        metrics.update({**sync.metrics(), **self.colocation.handoff_metrics()})
        if gated:                                                          # MIPU Step 2
            metrics.update(self.gate_update(step, snapshot))
            self.colocation.park_for_rollouts()                            # decided: the weights leave the GPU
        if self.optimizer_steps != optimizer_steps_before:  # a rollback or a skip restores the step count too
            self.rollouts.weights_changed()
        return metrics, prepared.num_tokens

    def update(
        self, step: int, prepared: PreparedBatch, snapshot: TrainingSnapshot | None,
    ) -> tuple[dict[str, float], NonFiniteUpdate | None]:
        """One optimizer step per mini-batch at RL step `step`'s learning rate; the update's metrics and its
        fault. On a fault the step counts as skipped and the mini-batches already stepped are undone from
        `snapshot` (`snapshot_before_update`); without one (train.nonfinite_rollback false) they stay applied."""
        update = update_policy(
            self.models.actor.model, self.models.optimizer, prepared.mini_batches,
            micro_batching=self.plan.micro_batching, algorithm=self.plan.algorithm, scoring=self.scoring,
            optim=self.optim, rl_step=step, constraint=self.constraint, warmup_from=self.warmup_from,
        )
        if update.old_scores is not None:  # an on-policy update scored the batch's old policy itself
            prepared.record_old_scores(update.old_scores)
        if update.fault is None:
            self.optimizer_steps += update.optimizer_steps
            self.consecutive_skips = 0
            return update.metrics, None
        kept = update.optimizer_steps if snapshot is None else 0  # mini-batches stepped before the fault that stay
        if update.optimizer_steps and snapshot is not None:
            snapshot.restore(self.models.actor.model, self.models.optimizer, self.constraint)
        self.optimizer_steps += kept
        self.consecutive_skips += 1
        if self.ctx.is_main:
            state = (f"its first {kept} mini-batch(es) stay applied (train.nonfinite_rollback false)" if kept else
                     "actor, optimizer and engines keep the state from before the step")
            log.warning("%s; update skipped (%d in a row): %s", update.fault.describe(), self.consecutive_skips, state)
        metrics = {**update.metrics, "train/nonfinite_skipped": 1.0, "train/nonfinite_kept_mini_batches": float(kept)}
        return metrics, update.fault

    def measures_geometry(self, step: int) -> bool:
        """Whether RL step `step` (0-based) logs its update's geometry (every `geometry_every` steps)."""
        return bool(self.geometry_every) and (step + 1) % self.geometry_every == 0

    def update_geometry(self, geometry: StepGeometry) -> dict[str, float]:
        """geometry/* of the update since `geometry` was captured (diagnostics/step_geometry.py) and its cost."""
        start = time.perf_counter()
        metrics = geometry.metrics(self.models.actor.module, self.models.ref.module)
        seconds = geometry.capture_seconds + time.perf_counter() - start
        return {**metrics, "perf/update_geometry_seconds": seconds}

    def snapshot_before_update(self, num_mini_batches: int) -> TrainingSnapshot | None:
        """theta_k and Omega_k before the update, when something may have to restore them: the MIPU gate (on the
        host when the GPU is shared until the gate has decided), or, with train.nonfinite_rollback, a non-finite
        mini-batch after the first (on the host: one copy of this rank's weights and optimizer state in host
        memory per RL step); else None."""
        if self.gate is None and (num_mini_batches <= 1 or not self.plan.train.nonfinite_rollback):
            return None
        return TrainingSnapshot.capture(self.models.actor.model, self.models.optimizer, self.optimizer_steps,
                                        self.constraint, to_host=self.colocation.offloaded or self.gate is None)

    # ----- MIPU Step 2 ----------------------------------------------------------------------

    def gate_update(self, step: int, snapshot: TrainingSnapshot) -> dict[str, float]:
        """Measure the synced candidate's inference gap; on reject restore actor, optimizer, subspace
        constraint and engine. Returns the gate's metrics."""
        start = time.perf_counter()
        models = self.models
        result = self.gate.measure(
            step, models.actor.model, models.actor.engine, pad_token_id=models.pad_token_id,
            micro_batching=self.plan.micro_batching, scoring=self.scoring,
        )
        if not result.accepted:
            with self.colocation.trainer_phase(resume_serving=False):
                snapshot.restore(models.actor.model, models.optimizer, self.constraint)
            self.optimizer_steps = snapshot.optimizer_steps
            self.colocation.push_actor_and_serve(self.engine_weights.push_actor)
            self.gate.record_rollback()
        return {
            "mipu/gap_proxy": result.gap,
            "mipu/tolerance": result.tolerance,
            "mipu/accepted": float(result.accepted),
            "mipu/rollbacks": float(self.gate.rollbacks),
            "mipu/gate_reward_mean": result.reward_mean,
            "perf/gate_seconds": time.perf_counter() - start,
        }

    # ----- after the update ----------------------------------------------------------------
    def capture_subspace(self, step: int) -> dict[str, float]:
        """With a subspace constraint: capture its span after step `constraint_capture_step` (later steps stay
        in the span of this cumulative update); its metrics."""
        if self.constraint is None:
            return {}
        if step + 1 == self.constraint_capture_step:
            with self.state_resident():  # reads the optimizer's fp32 master weights of a bf16 model
                self.constraint.capture(step + 1)
        return {"subspace/projected_steps": float(self.constraint.projected_steps)}

    def reset_reference(self) -> dict[str, float]:
        """Reference reset (ARMOR §4): the reference model and anchor engine become the current actor.

        Cached anchors are dropped, and so is a rollout generated ahead (its anchors are the old reference's); a
        shared engine holding the actor needs no push (it holds both now).
        """
        self.rollouts.discard_queued()
        actor, ref = self.models.actor, self.models.ref
        with torch.no_grad(), self.colocation.weights_resident(actor.name, ref.name):
            for ref_param, actor_param in zip(ref.module.parameters(), actor.module.parameters(), strict=True):
                ref_param.copy_(actor_param)
        self.anchors.reference_changed()
        self.engine_weights.reference_changed(to_actor=True)
        return {"armor/ref_reset": 1.0}

    def set_reference(self, reference_state: dict[str, Any]) -> dict[str, float]:
        """The anchor_keep action (collective): the reference gets the weights `reference_state` (a loaded actor
        entry of `sharded_state_dict`, e.g. the best checkpoint's) and is checkpointed from now on; the actor, its
        optimizer and the lr schedule go on untouched. Cached anchors and a rollout generated ahead are dropped (the
        old reference's), and the reference's engine gets the new weights. Its metrics."""
        self.rollouts.discard_queued()
        ref = self.models.ref
        with torch.no_grad(), self.colocation.weights_resident(ref.name):
            ref.load_state_dict(reference_state)
        self.checkpoints_reference = True
        self.anchors.reference_changed()
        self.engine_weights.reference_changed(to_actor=False)
        return {"armor/ref_reset": 1.0}

    # ----- the monitor's anchor action (trainer/guard/anchor_switch.py) -----------------------------
    def use_algorithm(self, algorithm: Algorithm) -> None:
        """Train `algorithm` from the next step on (what it samples, scores and its loss); the batch geometry stays."""
        self.plan = dataclasses.replace(self.plan, algorithm=algorithm)
        self.rollouts.phase.plan = self.plan

    def restart_from(self, state: dict[str, Any], step: int, *, warmup: bool = True) -> dict[str, float]:
        """ARMOR's restart (armor.md §4) after RL step `step` (1-based count of steps done; collective): the actor
        gets the weights of `state`'s "actor" (a loaded entry of `sharded_state_dict`, e.g. the best checkpoint's),
        its optimizer `state`'s "optimizer" when there is one, else a fresh one, and (`warmup`) an lr warmup counted
        from here; the reference becomes that actor (and is checkpointed from now on); the engines get the new
        weights, and a rollout generated ahead is dropped. Its metrics.

        Under LoRA (`Policy.adapters_only`) `state` holds the adapters (with the best checkpoint's Adam state), the
        base never moves and the reference stays the base: the restart resets the adapters (a LoRA run's reference
        reset: trainer/guard/adapter_reset.py, without the warmup)."""
        self.rollouts.discard_queued()
        actor = self.models.actor
        modules = self.checkpointed_modules()
        with self.colocation.state_writable():
            for name in restore_order(list(state)):
                restore_module(name, modules[name], state[name])
            if OPTIMIZER not in state:
                reset_optimizer(self.models.optimizer)
        if warmup:
            self.warmup_from = step
        if not actor.adapters_only:
            self.checkpoints_reference = True
        self.colocation.park_for_rollouts()
        self.engine_weights.push_actor()
        return {} if actor.adapters_only else self.reset_reference()

    # ----- run start-up, end and checkpoints -------------------------------------------------
    def push_initial_weights(self, stale: list[Policy]) -> None:
        """Before the first step (collective): park the trainer (offloaded, only the weights each push needs
        come back for it), then push the `stale` policies' weights into their engines."""
        self.colocation.park_for_rollouts()
        for policy in stale:
            self.engine_weights.push(policy)

    def close(self) -> None:
        """End the background work the trainer owns at the run's end (collective): the rollouts generating ahead
        and the anchors sampled ahead finish what they began, so no thread is left inside a collective."""
        self.rollouts.close()

    def state_resident(self) -> contextlib.AbstractContextManager:
        """Collective: all of the trainer's state readable inside (`Colocation.state_resident`): where
        `state_dict()` is taken and the checkpoint written."""
        return self.colocation.state_resident(self.engine_weights.push_actor)

    def checkpointed_modules(self) -> dict[str, Any]:
        """The objects whose `state_dict` a checkpoint holds: actor, optimizer, the subspace constraint, and the
        reference once it is not (only) model.ref_path's (reference resets, or restored from a checkpoint)."""
        actor, ref = self.models.actor, self.models.ref
        modules = {actor.name: actor, OPTIMIZER: self.models.optimizer}
        if self.constraint is not None:
            modules["subspace"] = self.constraint
        if self.checkpoints_reference:
            modules[ref.name] = ref
        return modules

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs besides the config and the RNG states.

        {"optimizer_steps": int, "consecutive_skips": int, "sampler": PromptSampler state, "mipu_gate": gate
        state (with a gate), "anchor_cache": cache state (with a cache), "modules": {name: state_dict() of each
        of `checkpointed_modules()`}}; all but "modules" is JSON-able and the same on every rank. The modules'
        tensors are this rank's shards, views of the live ones: offloaded, read them inside `state_resident()`.
        """
        modules = self.checkpointed_modules()
        return {**self._shared_state(), "modules": {name: module.state_dict() for name, module in modules.items()}}

    def sharded_state_dict(self, *, is_loading: bool = False, names: list[str] | None = None) -> dict[str, Any]:
        """`state_dict()` with "modules" as Megatron sharded state dicts (trainer/checkpointing/sharded_state.py), what
        a distributed checkpoint saves, or (`is_loading`) the request it loads into for the modules `names`
        (those a checkpoint holds; default `checkpointed_modules()`). Its loaded form goes to `load_state_dict`."""
        available = {**self.checkpointed_modules(), self.models.ref.name: self.models.ref}
        chosen = self.checkpointed_modules() if names is None else {n: available[n] for n in names if n in available}
        return {**self._shared_state(), "modules": sharded_modules(chosen, is_loading=is_loading)}

    def _shared_state(self) -> dict[str, Any]:
        """The JSON-able entries of `state_dict()`, the same on every rank."""
        state: dict[str, Any] = {"optimizer_steps": self.optimizer_steps, "consecutive_skips": self.consecutive_skips,
                                 "sampler": self.rollouts.sampler_state()}  # before a rollout generated ahead
        if self.gate is not None:
            state["mipu_gate"] = self.gate.state_dict()
        if (anchor_cache := self.anchors.state_dict()) is not None:
            state["anchor_cache"] = anchor_cache
        return state

    def load_state_dict(self, state: dict[str, Any]) -> bool:
        """Restore a `state_dict()`, or a loaded `sharded_state_dict()` (collective when offloaded: the modules
        load in a trainer phase); True when it held a reference.

        A reference in it is restored, and checkpointed from then on, whatever the plan says; without one
        the reference stays model.ref_path's. A cache's state is restored when it has one (none: saved with
        the cache off).
        """
        modules, ref = state["modules"], self.models.ref.name
        self.checkpoints_reference = self.checkpoints_reference or ref in modules
        expected = self.checkpointed_modules()
        missing = sorted(name for name in expected if name not in modules and name != ref)
        if missing:
            raise ValueError(f"the trainer state has no {missing} state (has {sorted(modules)}): it was saved by a "
                             f"run without them; resume with that run's config")
        with self.colocation.state_writable():
            for name in restore_order(list(expected)):
                if name in modules:
                    restore_module(name, expected[name], modules[name])
        self.rollouts.discard_queued()
        self.sampler.load_state_dict(state["sampler"])
        self.optimizer_steps = state["optimizer_steps"]
        self.consecutive_skips = state.get("consecutive_skips", 0)  # 0 in checkpoints from before skips were counted
        if self.gate is not None:
            self.gate.load_state_dict(state["mipu_gate"])
        if "anchor_cache" in state:
            self.anchors.load_state_dict(state["anchor_cache"])
        return ref in modules

