"""The RL step, top to bottom: rollout -> groups -> advantages -> logprobs -> update -> weight sync."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_armor.algorithms import (
    GroupCollector, build_groups, group_advantages, mismatch_k3, mix_kl_metrics, opd_token_advantages, reverse_kl,
)
from megatron_armor.algorithms.reduce import masked_mean
from megatron_armor.convert.weights import gather_all_stages_hf_weights
from megatron_armor.data.datasets import PromptRow, PromptSampler
from megatron_armor.data.types import Sample
from megatron_armor.diagnostics.subspace import SubspaceConstraint
from megatron_armor.distributed.init import DistributedContext
from megatron_armor.distributed.reduce import mean_over_data_parallel
from megatron_armor.models.hf_config import ModelShape
from megatron_armor.rollout.base import RolloutEngine, SamplingParams
from megatron_armor.rollout.weight_sync import SyncReport, sync_weights
from megatron_armor.teacher.scorer import TeacherScorer
from megatron_armor.trainer.anchor_cache import AnchorCache
from megatron_armor.scoring.batch import SequenceBatch, build_sequence_batch
from megatron_armor.scoring.logprobs import compute_logprobs
from megatron_armor.trainer.memory_handoff import MemoryHandoff
from megatron_armor.trainer.mipu_gate import InferenceGapGate, TrainingSnapshot
from megatron_armor.trainer.offload import TrainerOffload
from megatron_armor.trainer.optimizer import OptimizerSettings
from megatron_armor.trainer.policy_update import LossSettings, update_policy
from megatron_armor.trainer.rollout_stage import RolloutCounters, SampleScorer, call_seed, generate_samples


@dataclass(frozen=True)
class StepPlan:
    """Batch geometry and algorithm switches of an RL step (derived from the config)."""

    algorithm: str  # "armor" | "grpo" | "grpo_kl" | "mipu" | "opd"
    train_batch_size: int  # prompts per step
    mini_batch_size: int  # prompts per optimizer step
    micro_batch_size: int  # sequences per forward/backward
    actor_n: int
    ref_n: int
    filter_groups: bool
    max_num_gen_batches: int
    allow_partial_batch: bool
    adv_eps: float
    ref_reset_period: int
    seed: int
    advantage_baseline: str = "mean"  # "mean" (GRPO) | "quantile" (QAE): b of A = (R - b) / (std + eps)
    baseline_quantile: float = 0.45
    opd_beta: float = 1.0  # A_t = opd_alpha * (-opd_beta * (old - teacher)) + (1 - opd_alpha) * A_grpo
    opd_alpha: float = 1.0
    opd_token_fraction: float = 1.0  # keep ceil(fraction * T) tokens of each response's r_t (1: all)
    opd_token_selection: str = "top"  # "top" (largest r_t) | "random" (algorithms/opd.py)
    kl_coef: float = 0.0  # KL-to-reference loss weight (grpo_kl, mipu); > 0 needs reference logprobs

    @property
    def uses_anchors(self) -> bool:
        return self.algorithm == "armor"

    @property
    def needs_ref_logprobs(self) -> bool:
        return self.algorithm == "armor" or self.kl_coef > 0

    @property
    def distills(self) -> bool:
        return self.algorithm == "opd"


@dataclass
class PolicyHandles:
    """The models of one rank: trainable actor (DDP + optimizer), frozen reference (and OPD teacher), and engines.

    `teacher_engine` (OPD's off-policy variant, opd.rollouts teacher) samples the training
    responses in place of the actor's engine; it holds the teacher's weights and is never synced. The
    actor's engine still serves validation and receives the actor's weights after every update.
    """

    actor: torch.nn.Module  # Megatron DDP-wrapped GPTModel
    optimizer: object  # MegatronOptimizer
    ref: torch.nn.Module  # frozen GPTModel
    shape: ModelShape
    actor_engine: RolloutEngine
    ref_engine: RolloutEngine
    pad_token_id: int
    teacher: TeacherScorer | None = None  # OPD: frozen teacher, in-process or a scoring server
    teacher_engine: RolloutEngine | None = None  # OPD off-policy variant: the teacher samples

    @property
    def training_engine(self) -> RolloutEngine:
        """The engine that samples the training responses: the actor's, or the OPD teacher's."""
        return self.actor_engine if self.teacher_engine is None else self.teacher_engine

    @property
    def shared_engine(self) -> bool:
        """One engine serves both policies (rollout.anchors.engine shared); their weights take turns in it."""
        return self.ref_engine is self.actor_engine


@dataclass
class PreparedBatch:
    """A rank's training batch for one step: the whole local batch and its mini-batch views.

    entropy: token-mean policy entropy of the local batch before the update;
    num_tokens: prompt + response tokens of the whole step (all data-parallel ranks).
    """

    batch: SequenceBatch
    mini_batches: list[SequenceBatch]
    entropy: float
    num_tokens: int


class RLTrainer:
    """Runs RL steps; owns no I/O besides the engines (metrics/checkpoints are the caller's).

    With a `gate` (MIPU Step 2) every step snapshots the actor first and rolls back actor, optimizer
    and engine when the post-update inference gap is out of tolerance. With an `anchor_cache` a
    prompt's anchors are sampled once per reference (see trainer/anchor_cache.py).

    Colocated with its servers, the trainer frees the GPU for them: a `memory_handoff` has the servers
    release their memory for each training phase, an `offload` parks the trainer's own state for the
    rollout phase (`park_for_rollouts`, `trainer_phase`, `weights_resident`).

    With one engine shared by both policies, `engine_holds` names the policies whose current weights
    it holds: the actor's after every push of them (engines start with them: run.py pushes them when
    they might not), both right after a reference reset (the reference is then the actor), the
    reference's after an anchor phase. Every rank runs the same calls, so it is the same on all ranks.
    """

    def __init__(
        self, ctx: DistributedContext, handles: PolicyHandles, plan: StepPlan, sampler: PromptSampler,
        sampling: SamplingParams, scorer: SampleScorer, loss: LossSettings, optim: OptimizerSettings,
        gate: InferenceGapGate | None = None, constraint: SubspaceConstraint | None = None,
        constraint_capture_step: int = 0, anchor_cache: AnchorCache | None = None,
        memory_handoff: MemoryHandoff | None = None, offload: TrainerOffload | None = None,
    ) -> None:
        self.ctx, self.h, self.plan, self.sampler = ctx, handles, plan, sampler
        self.sampling, self.scorer, self.loss, self.optim = sampling, scorer, loss, optim
        self.gate = gate
        self.constraint, self.constraint_capture_step = constraint, constraint_capture_step
        self.anchor_cache = anchor_cache
        self.memory_handoff, self.offload = memory_handoff, offload
        self.optimizer_steps = 0
        self.engine_holds: set[str] = {"actor"}  # "actor" / "ref": meaningful for a shared engine only

    # ----- rollout -------------------------------------------------------------------------
    def collect_groups(self, step: int) -> tuple[list[list[Sample]], dict[str, float]]:
        """Generate until `train_batch_size` prompts survive filtering (ARMOR §1).

        A partial batch (allow_partial_batch) is cut to a multiple of the data-parallel size
        (`trim_to_data_parallel`); it may then be empty. Every rank holds the same groups.
        """
        plan = self.plan
        collector = GroupCollector(
            target_prompts=plan.train_batch_size, max_num_gen_batches=plan.max_num_gen_batches,
            allow_partial=plan.allow_partial_batch,
        )
        on_policy_all: list[Sample] = []
        anchors_all: list[Sample] = []
        counters = RolloutCounters()
        phases = {"actor": self.sample_on_policy, "ref": self.sample_anchors}
        while not collector.done:
            batch_index = collector.num_gen_batches
            prompts = [dataclasses.replace(p, index=i) for i, p in enumerate(self.sampler.next_batch())]
            samples = {
                policy: phases[policy](prompts, (plan.seed, step, batch_index, policy), counters)
                for policy in self.phase_order()
            }
            on_policy, anchors = samples["actor"], samples.get("ref", [])
            groups, stats = build_groups(
                on_policy + anchors, require_anchor=plan.uses_anchors, filter_groups=plan.filter_groups
            )
            collector.add(groups, stats)
            on_policy_all += on_policy
            anchors_all += anchors
        groups = trim_to_data_parallel(collector.result(), self.ctx.dp_size)
        metrics = {
            "train/reward_mean": _mean([s.reward for s in on_policy_all]),
            "train/accuracy": _mean([float(s.correct) for s in on_policy_all]),
            "train/num_gen_batches": float(collector.num_gen_batches),
            "response/length_mean": _mean([len(s.response_ids) for s in on_policy_all]),
            "armor/prompts_kept": float(len(groups)),
            "armor/prompts_generated": float(collector.stats.prompts_seen),
            "armor/anchors_used": float(sum(s.is_anchor for g in groups for s in g)),
        }
        if anchors_all:
            metrics["armor/anchor_accuracy"] = _mean([float(s.correct) for s in anchors_all])
        if plan.uses_anchors and groups:  # armor.md §7: the fraction of on-policy samples in the batch
            metrics["mix_kl/main_ratio"] = _mean([float(not s.is_anchor) for g in groups for s in g])
        metrics.update(counters.metrics(
            uses_anchors=plan.uses_anchors, cache=self.anchor_cache is not None, shared=self.h.shared_engine
        ))
        metrics.update(self.h.actor_engine.metrics())
        return groups, metrics

    def phase_order(self) -> tuple[str, ...]:
        """Policies to sample in a generation batch: the actor, and the reference for ARMOR's anchors.

        A shared engine samples first with the weights it holds, so a batch swaps them at most once:
        with one generation batch per step that is one reference push per step, the actor's weights
        being pushed after the update anyway.
        """
        if not self.plan.uses_anchors:
            return ("actor",)
        return ("ref", "actor") if "actor" not in self.engine_holds else ("actor", "ref")

    def sample_on_policy(self, prompts: list[PromptRow], seed: tuple, counters: RolloutCounters) -> list[Sample]:
        """`actor_n` scored samples of every prompt from the actor (collective).

        OPD's off-policy variant draws them from the teacher's engine instead (`PolicyHandles.training_engine`):
        the student then trains on the teacher's tokens with the same r_t and loss, and no importance weight
        corrects for sampling from q_T instead of pi_old (as in opd.md §1, variants).
        """
        counters.add_push("actor", self.load_into_shared_engine("actor"))
        return generate_samples(
            self.h.training_engine, prompts, self.plan.actor_n, self.sampling, self.scorer, is_anchor=False, seed=seed
        )

    def sample_anchors(self, prompts: list[PromptRow], seed: tuple, counters: RolloutCounters) -> list[Sample]:
        """`ref_n` anchors of every prompt from the reference, sampled or from the cache (collective)."""
        start = time.perf_counter()

        def generate(missing: list[PromptRow]) -> list[Sample]:
            counters.add_push("ref", self.load_into_shared_engine("ref"))
            return generate_samples(
                self.h.ref_engine, missing, self.plan.ref_n, self.sampling, self.scorer, is_anchor=True, seed=seed
            )

        if self.anchor_cache is None:
            anchors = generate(prompts)
        else:
            anchors, hits = self.anchor_cache.fetch(prompts, generate)
            counters.anchor_cache_hits += hits
        counters.anchor_seconds += time.perf_counter() - start
        return anchors

    # ----- training batch ------------------------------------------------------------------
    def prepare_batch(self, groups: list[list[Sample]]) -> PreparedBatch:
        """This data-parallel rank's share of each mini-batch, with advantages and old/ref logprobs."""
        plan, ctx = self.plan, self.ctx
        samples = [s for g in groups for s in g]
        group_ids = torch.tensor([gi for gi, g in enumerate(groups) for _ in g], dtype=torch.long)
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        advantages = group_advantages(rewards, group_ids, eps=plan.adv_eps, baseline=plan.advantage_baseline,
                                      quantile=plan.baseline_quantile)
        group_start = [0]
        for g in groups:
            group_start.append(group_start[-1] + len(g))
        rows = [  # sample rows of each local mini-batch
            [r for gi in local for r in range(group_start[gi], group_start[gi + 1])]
            for local in local_mini_batch_groups(len(groups), plan.mini_batch_size, ctx.dp_size, ctx.dp_rank)
        ]
        order = [r for mini in rows for r in mini]
        batch = build_sequence_batch(
            [samples[r] for r in order], advantages[order].tolist(), pad_token_id=self.h.pad_token_id
        )
        old = compute_logprobs(
            self.h.actor, batch, micro_batch_size=plan.micro_batch_size, scoring=self.loss.scoring(with_entropy=True)
        )
        batch.old_logprobs = old.logprobs
        if plan.needs_ref_logprobs:
            batch.ref_logprobs = compute_logprobs(
                self.h.ref, batch, micro_batch_size=plan.micro_batch_size, scoring=self.loss.scoring()
            ).logprobs
        if plan.distills:
            batch.teacher_logprobs = self.h.teacher.score(batch)
            batch.token_advantages = opd_token_advantages(
                batch.old_logprobs, batch.teacher_logprobs, batch.response_mask, beta=plan.opd_beta,
                alpha=plan.opd_alpha, sequence_advantages=batch.advantages, token_fraction=plan.opd_token_fraction,
                token_selection=plan.opd_token_selection,  # random draws: one stream per step and data shard
                generator=torch.Generator().manual_seed(call_seed(plan.seed, self.optimizer_steps, "opd", ctx.dp_rank)),
            )
        bounds = [0]
        for mini in rows:
            bounds.append(bounds[-1] + len(mini))
        return PreparedBatch(
            batch=batch,
            mini_batches=[batch.select(slice(a, b)) for a, b in zip(bounds[:-1], bounds[1:])],
            entropy=float(masked_mean(old.entropy, batch.response_mask)),
            num_tokens=sum(len(s.prompt_ids) + len(s.response_ids) for s in samples),
        )

    def batch_metrics(self, prepared: PreparedBatch) -> dict[str, float]:
        """Metrics of a prepared batch, before the update: entropy, train/rollout mismatch (mean |diff|
        and Mismatch-K3 on on-policy tokens; none when the OPD teacher sampled the batch), mix KL, OPD
        reverse KL.

        Each is computed on the rank's data-parallel shard and averaged over data-parallel ranks.
        """
        batch = prepared.batch
        metrics = {"policy/entropy": prepared.entropy}
        if self.h.teacher_engine is None:  # engine_logprobs are the actor engine's
            on_policy = ~batch.is_anchor
            diff = (batch.old_logprobs - batch.engine_logprobs).abs() * batch.response_mask
            per_sample = diff.sum(1) / batch.response_mask.sum(1).clamp(min=1)
            on_policy_mask = batch.response_mask * on_policy[:, None]
            metrics["mismatch/logprob_abs_diff"] = float(per_sample[on_policy].mean()) if on_policy.any() else 0.0
            metrics["mismatch/k3"] = float(mismatch_k3(batch.old_logprobs, batch.engine_logprobs, on_policy_mask))
        if batch.ref_logprobs is not None:  # keys from the plan, not the shard: the same on every rank
            metrics.update(mix_kl_metrics(batch.old_logprobs, batch.ref_logprobs, batch.is_anchor, batch.response_mask,
                                          with_anchors=self.plan.uses_anchors))
        if batch.teacher_logprobs is not None:
            metrics["opd/reverse_kl"] = float(reverse_kl(batch.old_logprobs, batch.teacher_logprobs, batch.response_mask))
        return mean_over_data_parallel(metrics)

    # ----- one RL step ---------------------------------------------------------------------
    def step(self, step: int) -> dict[str, float]:
        """Run RL step `step` (0-based) and return its metrics.

        When filtering leaves no prompts (allow_partial_batch) every rank skips the update, the weight
        sync and the gate alike, and `train/update_skipped` is 1.
        """
        t0 = time.perf_counter()
        self.park_for_rollouts()
        groups, metrics = self.collect_groups(step)
        t_rollout = time.perf_counter()
        num_tokens = self.train_on(step, groups, metrics) if groups else 0
        metrics["train/update_skipped"] = float(not groups)
        if self.constraint is not None:
            if step + 1 == self.constraint_capture_step:
                with self.state_resident():  # reads the optimizer's fp32 master weights of a bf16 model
                    self.constraint.capture(step + 1)  # later steps stay in the span of this cumulative update
            metrics["subspace/projected_steps"] = float(self.constraint.projected_steps)
        if self.plan.ref_reset_period and (step + 1) % self.plan.ref_reset_period == 0:
            self.reset_reference()
            metrics["armor/ref_reset"] = 1.0
        if self.offload is not None:
            metrics.update(self.offload.metrics())
        t_end = time.perf_counter()
        metrics.update({
            "perf/rollout_seconds": t_rollout - t0,
            "perf/step_seconds": t_end - t0,
            "perf/tokens_per_second": num_tokens / max(t_end - t0, 1e-9),
        })
        return metrics

    def train_on(self, step: int, groups: list[list[Sample]], metrics: dict[str, float]) -> int:
        """Update the actor on `groups` at RL step `step`'s learning rate, push it to the engine and (MIPU)
        gate it; adds the metrics to `metrics` and returns the step's prompt + response token count."""
        t0 = time.perf_counter()
        with self.trainer_phase(resume_serving=False):
            prepared = self.prepare_batch(groups)
            metrics.update(self.batch_metrics(prepared))
            snapshot = (  # on the host when the GPU is to be shared until the gate has decided
                TrainingSnapshot.capture(self.h.actor, self.h.optimizer, self.optimizer_steps, self.constraint,
                                         to_host=self.offload is not None)
                if self.gate else None
            )
            update = update_policy(
                self.h.actor, self.h.optimizer, prepared.mini_batches, micro_batch_size=self.plan.micro_batch_size,
                loss=self.loss, optim=self.optim, rl_step=step, constraint=self.constraint,
            )
        self.optimizer_steps += update.optimizer_steps
        metrics.update(update.metrics)
        metrics["perf/train_seconds"] = time.perf_counter() - t0
        metrics.update(self.push_actor_and_serve(keep_weights=snapshot is not None).metrics())
        if self.memory_handoff is not None:
            metrics["perf/memory_handoff_seconds"] = self.memory_handoff.seconds
        if snapshot is not None:
            t_gate = time.perf_counter()
            metrics.update(self.gate_update(step, snapshot))
            metrics["perf/gate_seconds"] = time.perf_counter() - t_gate
            self.park_for_rollouts()  # the gate has decided: the trainer's weights leave before validation
        return prepared.num_tokens

    # ----- MIPU Step 2 ----------------------------------------------------------------------
    def gate_update(self, step: int, snapshot: TrainingSnapshot) -> dict[str, float]:
        """Measure the synced candidate's inference gap; on reject restore actor, optimizer, subspace
        constraint and engine."""
        result = self.gate.measure(
            step, self.h.actor, self.h.actor_engine, pad_token_id=self.h.pad_token_id,
            micro_batch_size=self.plan.micro_batch_size, scoring=self.loss.scoring(),
        )
        if not result.accepted:
            with self.trainer_phase(resume_serving=False):
                snapshot.restore(self.h.actor, self.h.optimizer, self.constraint)
            self.optimizer_steps = snapshot.optimizer_steps
            self.push_actor_and_serve()
            self.gate.rollbacks += 1
        return {
            "mipu/gap_proxy": result.gap,
            "mipu/tolerance": result.tolerance,
            "mipu/accepted": float(result.accepted),
            "mipu/rollbacks": float(self.gate.rollbacks),
            "mipu/gate_reward_mean": result.reward_mean,
        }

    # ----- GPU phases (colocated) ---------------------------------------------------------
    @contextlib.contextmanager
    def trainer_phase(self, *, resume_serving: bool = True) -> Iterator[None]:
        """Collective: the trainer owns the GPU inside (logprobs, the update, a rollback, a checkpoint save).

        The servers release their memory (`memory_handoff`) before the trainer's state comes back
        (`offload`); after the block all of it but the actor's weights, which the push and the gate
        that follow read, leaves again before the servers take their memory back: all of it, or with
        `resume_serving` False their weights' memory only (`push_actor_and_serve` follows).
        """
        handoff = (self.memory_handoff.training_phase(resume_serving=resume_serving) if self.memory_handoff
                   else contextlib.nullcontext())
        with handoff, (self.offload.training_phase() if self.offload else contextlib.nullcontext()):
            yield

    def push_actor_and_serve(self, *, keep_weights: bool = False) -> SyncReport:
        """Collective, after `trainer_phase(resume_serving=False)`: push the actor's weights into servers that
        have their weights' memory back (their old values are lost without --enable-weights-cpu-backup),
        park the trainer's copy (unless `keep_weights`: the MIPU gate scores with it), then give the
        servers their KV cache and CUDA graphs back: this push never shares the GPU with a KV cache."""
        try:
            report = self.sync_actor_to_engine()
            if not keep_weights:
                self.park_for_rollouts()
        except BaseException:
            if self.memory_handoff is not None:
                self.memory_handoff.recover()
            raise
        if self.memory_handoff is not None:
            self.memory_handoff.resume_serving()
        return report

    def park_for_rollouts(self) -> None:
        """Offloaded: nothing of the trainer on the GPU (a rollout phase starts; also after start-up)."""
        if self.offload is not None:
            self.offload.park()

    @contextlib.contextmanager
    def state_resident(self) -> Iterator[None]:
        """Collective: all of the trainer's state readable inside (a checkpoint save, the subspace capture).

        Offloaded, that takes a trainer phase (the servers' memory for the optimizer state), after which
        servers that released their memory get the actor's weights pushed again, which the release lost
        (a shared engine then holds the actor's); not offloaded, the state is always there.
        """
        if self.offload is None:
            yield
            return
        with self.trainer_phase(resume_serving=False):
            yield
        if self.memory_handoff is not None:
            self.push_actor_and_serve()

    def weights_resident(self, *models: str) -> contextlib.AbstractContextManager:
        """The named models' ("actor", "ref") weights on the GPU inside the block (a push, a reference reset),
        parked after if they were."""
        return self.offload.weights_resident(*models) if self.offload else contextlib.nullcontext()

    # ----- weights -------------------------------------------------------------------------
    def sync_actor_to_engine(self) -> SyncReport:
        """Push the actor's current weights (TP- and PP-gathered, HF-named) into the on-policy engine."""
        return self._push("actor")

    def sync_ref_to_engine(self) -> SyncReport:
        """Push the reference model's weights into the anchor engine."""
        return self._push("ref")

    def load_into_shared_engine(self, policy: str) -> SyncReport | None:
        """With one shared engine, push `policy`'s weights ("actor" | "ref") unless it holds them; else None."""
        if not self.h.shared_engine or policy in self.engine_holds:
            return None
        return self._push(policy)

    def reset_reference(self) -> None:
        """Reference reset (ARMOR §4): the reference model and anchor engine become the current actor.

        Cached anchors are dropped; a shared engine holding the actor needs no push (it holds both now).
        """
        with torch.no_grad(), self.weights_resident("actor", "ref"):
            for ref_param, actor_param in zip(self.h.ref.parameters(), self.h.actor.module.parameters(), strict=True):
                ref_param.copy_(actor_param)
        if self.anchor_cache is not None:
            self.anchor_cache.clear()
        if not self.h.shared_engine:
            self.sync_ref_to_engine()
        else:
            self.engine_holds = {"actor", "ref"} if "actor" in self.engine_holds else set()

    def _push(self, policy: str) -> SyncReport:
        h = self.h
        engine, module = (h.actor_engine, h.actor.module) if policy == "actor" else (h.ref_engine, h.ref)
        with self.weights_resident(policy):
            report = push_weights(engine, gather_all_stages_hf_weights(module, self.h.shape))
        if self.offload is not None:  # offloaded: the push's staging buffers leave the GPU with the weights
            engine.release_transfer_buffers()
        if self.h.shared_engine:
            self.engine_holds = {policy}
        return report


def trim_to_data_parallel(groups: list[list[Sample]], dp_size: int) -> list[list[Sample]]:
    """The first len(groups) - len(groups) % dp_size groups: a multiple of the data-parallel size, so
    every mini-batch deals at least one group to every rank (`local_mini_batch_groups`)."""
    return groups[: len(groups) - len(groups) % dp_size]


def local_mini_batch_groups(num_groups: int, mini_batch_size: int, dp_size: int, dp_rank: int) -> list[list[int]]:
    """Group indices of rank `dp_rank`'s share of each mini-batch (group gi goes to rank gi % dp_size).

    Both counts must be multiples of dp_size (config validation, `trim_to_data_parallel`): then no
    share is empty and every rank gets ceil(num_groups / mini_batch_size) mini-batches, i.e. runs the
    same optimizer steps (and collectives).
    """
    if num_groups % dp_size or mini_batch_size % dp_size:
        raise ValueError(f"{num_groups} groups in mini-batches of {mini_batch_size} cannot be dealt evenly to "
                         f"{dp_size} data-parallel ranks (both must be multiples of it)")
    return [
        [gi for gi in range(start, min(start + mini_batch_size, num_groups)) if gi % dp_size == dp_rank]
        for start in range(0, num_groups, mini_batch_size)
    ]


def push_weights(engine: RolloutEngine, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> SyncReport:
    """Collective: every rank runs the gather (each holds every full tensor) and sends it to the servers its
    engine pushes to (`pushes_weights`); a shared engine's servers are all served once the barrier passes.

    Returns this rank's measurement (bytes and seconds, the TP/PP gather included).
    """
    report = sync_weights(engine, named_tensors, send=engine.pushes_weights)
    if engine.shared_across_ranks:
        dist.barrier()
    return report


def evaluate(
    engine: RolloutEngine, prompts: list[PromptRow], scorer: SampleScorer, sampling: SamplingParams, *, n: int, seed: tuple
) -> dict[str, float]:
    """Validation accuracy (mean correctness over `n` samples of every prompt) and reward."""
    samples = generate_samples(engine, prompts, n, sampling, scorer, is_anchor=False, seed=seed)
    return {
        "val/accuracy": _mean([float(s.correct) for s in samples]),
        "val/reward_mean": _mean([s.reward for s in samples]),
        "val/response_length": _mean([len(s.response_ids) for s in samples]),
    }


def _mean(values) -> float:
    values = list(values)
    return float(sum(values) / len(values)) if values else 0.0

