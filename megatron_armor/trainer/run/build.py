"""Build every component of a training run from an `ArmorConfig`: engines, models, data, scorers, the
step's settings and the `RLTrainer` (collective: every rank builds its own in the same order)."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
from dataclasses import dataclass
from collections.abc import Iterable
from typing import Any

import torch

from megatron_armor.algorithms import ACTOR, REFERENCE, TEACHER, Algorithm, GateSettings
from megatron_armor.config import ArmorConfig
from megatron_armor.convert.loading import PARAMS_DTYPES
from megatron_armor.convert.megatron_checkpoint import is_megatron_checkpoint
from megatron_armor.convert.peft_export import all_stages_peft_tensors, peft_config
from megatron_armor.convert.weights import parameters_exported_as_views
from megatron_armor.data.datasets import PromptRow, check_tokenizer_fits_model
from megatron_armor.diagnostics.subspace import SubspaceConstraint
from megatron_armor.distributed.device import training_device
from megatron_armor.distributed.init import DistributedContext
from megatron_armor.models.hf_config import ModelShape, check_parallel_layout, load_model_shape
from megatron_armor.models.lora import adapter_entries, adapters_disabled, apply_lora
from megatron_armor.models.tokenizer import load_tokenizer
from megatron_armor.rewards.reward_fns import RewardFns
from megatron_armor.rollout.adapter_dir import AdapterDir
from megatron_armor.rollout.adapter_engine import AdapterEngine
from megatron_armor.rollout.base import RolloutEngine, SamplingParams
from megatron_armor.rollout.backends import ROLLOUT_BACKENDS, EngineSite
from megatron_armor.rollout.local import LocalEngine
from megatron_armor.scoring.routes import REPLAY_MODES
from megatron_armor.rollout.tensor_serialization import share_storages
from megatron_armor.teacher.scorer import InProcessTeacher, TeacherScorer, check_teacher_vocab, connect_remote_teacher
from megatron_armor.teacher.serve_cli import TeacherServerConfig
from megatron_armor.scoring.logprobs import ScoringConfig, resolve_logprob_head
from megatron_armor.scoring.micro_batches import MicroBatching, sequence_multiple
from megatron_armor.trainer.colocation.colocation import Colocation
from megatron_armor.trainer.colocation.memory_handoff import MemoryHandoff
from megatron_armor.trainer.colocation.offload import TrainerOffload
from megatron_armor.trainer.rollouts.rollout_phase import RolloutSources
from megatron_armor.trainer.rollouts.samples import SampleScorer
from megatron_armor.trainer.run.task_setup import TaskPaths
from megatron_armor.trainer.step.loop import RLTrainer, TrainerParts
from megatron_armor.trainer.step.validation import Validation
from megatron_armor.trainer.step_inputs.plan import StepPlan
from megatron_armor.trainer.step_inputs.policies import Policy, PolicyHandles
from megatron_armor.trainer.update.update_gate import InferenceGapGate

log = logging.getLogger("megatron_armor")
ACTOR_ADAPTER = "actor"  # the name the actor's LoRA adapter has in its engine (model.lora.weight_sync adapter)


@dataclass
class TrainingSetup:
    """Everything a run uses: the trainer, the models and engines it was built on (for validation, the
    model export of a checkpoint and teardown), and what validation needs besides."""

    trainer: RLTrainer
    models: PolicyHandles
    validation: Validation


def context_length_warning(cfg: ArmorConfig, shape: ModelShape) -> str | None:
    """Why SGLang servers would refuse the run's longest requests, or None."""
    positions = cfg.data.max_prompt_length + cfg.rollout.sampling.max_new_tokens
    if positions <= shape.max_position_embeddings:
        return None
    return (f"data.max_prompt_length + rollout.sampling.max_new_tokens = {positions} positions, but the model's "
            f"config.json says max_position_embeddings {shape.max_position_embeddings}: SGLang servers refuse longer "
            f"requests unless started with --context-length (or the config raises it)")


def build_training(
    ctx: DistributedContext, cfg: ArmorConfig, algorithm: Algorithm, paths: TaskPaths, rewards: RewardFns | None = None,
) -> TrainingSetup:
    """Models, engines, data, scorers and the `RLTrainer` of this rank, as `cfg` and `algorithm` (built from it)
    say (collective); `rewards` loaded beforehand (`RewardFns.load`), else here, before any model."""
    rewards = rewards or cfg.reward.build()
    tokenizer = load_tokenizer(paths.model_path)
    shape = load_model_shape(paths.model_path)
    check_tokenizer_fits_model(tokenizer, shape.vocab_size)
    if (warning := context_length_warning(cfg, shape)) and ctx.is_main:
        log.warning("%s (%s)", warning, paths.model_path)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    actor_engine, ref_engine = cfg.rollout.build(site=_engine_site(cfg, paths, pad_token_id, ctx.rank))
    teacher_engine = _teacher_engine(cfg, paths, pad_token_id) if algorithm.sources.sampler == TEACHER else None
    handoff = cfg.rollout.memory.build(actor_engine=actor_engine, ref_engine=ref_engine)
    trainer_models = _build_models(cfg, algorithm, paths, shape, handoff, (actor_engine, ref_engine))
    stop_ids = (tokenizer.eos_token_id,)
    sampling = cfg.rollout.sampling.build(stop_token_ids=stop_ids)
    val_sampling = cfg.rollout.sampling.build(stop_token_ids=stop_ids, validation=True)
    teacher = trainer_models.teacher
    teacher_model = teacher.model if isinstance(teacher, InProcessTeacher) else None  # None: a scoring server
    models = PolicyHandles(
        actor=_actor(cfg, paths, trainer_models, actor_engine, rank=ctx.rank),
        ref=_reference(trainer_models, ref_engine),
        optimizer=trainer_models.optimizer, shape=shape, pad_token_id=pad_token_id,
        teacher=None if teacher is None else Policy(TEACHER, teacher_model, teacher_engine, teacher),
    )
    prompts = cfg.data.build(tokenizer=tokenizer, train_path=paths.train_path, val_path=paths.val_path,
                             batch_size=cfg.train.gen_batch_size, seed=cfg.train.seed)
    train_scorer = _train_scorer(cfg, tokenizer, rewards)
    val_scorer = SampleScorer(tokenizer, rewards.val)
    gate_scorer = train_scorer if train_scorer.rolls_out_trajectories else val_scorer  # trajectories: the env's reward
    gate = _update_gate(cfg, algorithm.update_gate(), prompts.validation, gate_scorer, sampling)
    parts = TrainerParts(gate=gate, constraint=trainer_models.constraint,
                         constraint_capture_step=cfg.subspace.capture_step, anchor_cache=cfg.rollout.anchors.build(),
                         colocation=Colocation(handoff, trainer_models.offload),
                         geometry_every=cfg.logging.update_geometry_every)
    trainer = RLTrainer(ctx, models, step_plan(cfg, algorithm), RolloutSources(prompts.train, sampling, train_scorer),
                        _scoring(cfg), cfg.optimizer, parts)
    validation = Validation.load(cfg, tokenizer, stop_ids, prompts.validation, val_scorer, val_sampling,
                                 tool_scorer=train_scorer if train_scorer.rolls_out_trajectories else None)
    return TrainingSetup(trainer=trainer, models=models, validation=validation)


def step_plan(cfg: ArmorConfig, algorithm: Algorithm) -> StepPlan:
    """`algorithm`'s steps by the train, rollout and algorithm sections, with micro-batches padded for this run's
    tensor-parallel size and the on-policy samples per prompt the algorithm fixes (`Algorithm.on_policy_samples`)."""
    return StepPlan(algorithm, cfg.train, cfg.rollout, cfg.algorithm, _micro_batching(cfg),
                    actor_n=algorithm.on_policy_samples(cfg.rollout.sampling))


def _micro_batching(cfg: ArmorConfig) -> MicroBatching:
    """The micro_batching section's micro-batches, padded to the multiple this run's tensor-parallel size needs."""
    return cfg.micro_batching.build(pad_to_multiple_of=sequence_multiple(cfg.parallel.tensor_parallel_size))


def _scoring(cfg: ArmorConfig) -> ScoringConfig:
    """How the run's last stage scores tokens: at the temperature of rollout.sampling (tokens are scored under the
    distribution the engines sampled from, or the importance ratios would compare different distributions), with
    train.logprob_head's head ("auto" resolved for this machine)."""
    return ScoringConfig(temperature=cfg.rollout.sampling.temperature, head=resolve_logprob_head(cfg.train.logprob_head))


def _train_scorer(cfg: ArmorConfig, tokenizer, rewards: RewardFns) -> SampleScorer:
    """What turns the training prompts into scored samples: one completion each, or with rollout.agentic.environment
    (or rollout_fn) a trajectory of that environment (or function) each (trainer/rollouts/trajectories.py)."""
    agentic = cfg.rollout.agentic
    if agentic.rolls_out:
        return agentic.build(tokenizer=tokenizer, in_process=cfg.rollout.backend_settings.in_process,
                             audits=rewards.audits)
    return SampleScorer(tokenizer, rewards.train, cfg.reward, max_response_length=cfg.rollout.sampling.max_new_tokens,
                        audits=rewards.audits)


def _actor(cfg: ArmorConfig, paths: TaskPaths, models: TrainerModels, engine: RolloutEngine, *, rank: int) -> Policy:
    """The actor policy. Under model.lora.weight_sync adapter its engine holds the base, and the actor samples
    through its adapter there (`AdapterEngine`), to which each push sends the adapters alone (PEFT-named,
    `convert.peft_export.all_stages_peft_tensors`), with model.lora.push_dir by path (this `rank`'s versions: every
    rank that pushes writes its own)."""
    lora = cfg.model.lora
    if not lora.adapter_sync:
        return Policy(ACTOR, models.ddp, engine, adapters_only=lora.enabled)
    config = functools.partial(peft_config, lora, base_model=paths.model_path)
    push_dir = None if lora.push_dir is None else AdapterDir(lora.push_dir, f"{ACTOR_ADAPTER}-rank{rank}")
    return Policy(ACTOR, models.ddp, AdapterEngine(engine, ACTOR_ADAPTER, config, push_dir), weights=_adapter_tensors,
                  adapters_only=True)


def _adapter_tensors(model: torch.nn.Module, shape: ModelShape) -> Iterable[tuple[str, torch.Tensor]]:
    """The LoRA adapters of every stage, whole and PEFT-named (collective): an adapter-only push."""
    return all_stages_peft_tensors(model, shape).items()


def _reference(models: TrainerModels, engine: RolloutEngine) -> Policy:
    """The reference policy: its own frozen model, or under LoRA (no `models.ref`) the actor's model with the adapters
    off (`models.lora.adapters_disabled`): the base, which no second model holds."""
    if models.ref is None:
        return Policy(REFERENCE, models.ddp, engine, checkpoint_prefix="ref.",
                      view=functools.partial(adapters_disabled, models.ddp))
    return Policy(REFERENCE, models.ref, engine, checkpoint_prefix="ref.")


@dataclass
class TrainerModels:
    """A rank's models: the DDP-wrapped actor (with model.lora, its adapters only trainable) and its optimizer, the
    frozen reference (none under LoRA), the OPD teacher, the
    subspace constraint over the actor's weights, and the offload of them all (rollout.memory.offload_trainer)."""

    ddp: torch.nn.Module
    optimizer: Any
    ref: torch.nn.Module | None  # None under LoRA: the reference is the actor's model with its adapters off
    teacher: TeacherScorer | None
    constraint: SubspaceConstraint | None
    offload: TrainerOffload | None


def _build_models(
    cfg: ArmorConfig, algorithm: Algorithm, paths: TaskPaths, shape: ModelShape, handoff: MemoryHandoff | None,
    engines: tuple[RolloutEngine, RolloutEngine],
) -> TrainerModels:
    """The models of this rank (collective). Colocated, the servers release their GPU memory while the
    models are built (`handoff`), and an offloaded trainer parks them before the servers take it back
    (the servers get their weights from the first pushes, which bring the trainer's copy of each back
    for the push alone)."""
    with handoff.training_phase() if handoff else contextlib.nullcontext():
        sequence_parallel = _sequence_parallel(cfg, shape)
        actor = cfg.model.build(path=paths.model_path, shape=shape, trainable=True, recompute=cfg.recompute,
                                sequence_parallel=sequence_parallel)
        lora = cfg.model.lora
        if lora.enabled:
            apply_lora(actor, lora, seed=cfg.train.seed)
        ddp, optimizer = cfg.optimizer.build(
            model=actor, distributed=cfg.optimizer.distributed(cfg.parallel, cfg.subspace, cfg.rollout.memory))
        ref = None if lora.enabled else cfg.model.build(path=paths.ref_path, shape=shape,
                                                         sequence_parallel=sequence_parallel)
        teacher = _teacher(cfg, paths, shape) if algorithm.sources.uses(TEACHER) else None
        constraint = cfg.subspace.build(model=ddp.module)
        offload = None
        if cfg.rollout.memory.offload_trainer:
            frozen = {REFERENCE: ref, **({TEACHER: teacher.model} if isinstance(teacher, InProcessTeacher) else {})}
            offload = TrainerOffload(ddp, optimizer, frozen, constraint)
            offload.park()
        elif _pushes_cpu_weights_by_handle(cfg):  # the models this rank pushes to servers (engines: actor, ref)
            pushed = [module for module, engine in zip((ddp.module, ref), engines)
                      if module is not None and engine.pushes_weights]
            moved = share_storages(itertools.chain.from_iterable(parameters_exported_as_views(m, shape) for m in pushed))
            if pushed:
                log.info("weights in shared memory for per-tensor pushes: %.1f MiB", moved / 2**20)
    return TrainerModels(ddp, optimizer, ref, teacher, constraint, offload)


def _sequence_parallel(cfg: ArmorConfig, shape: ModelShape) -> bool:
    """parallel.sequence_parallel as this run's models use it (on by default on GPU at TP > 1, and for MoE)."""
    return cfg.parallel.resolve_sequence_parallel(on_gpu=training_device().type == "cuda", moe=bool(shape.num_experts))


def start_weights(cfg: ArmorConfig, paths: TaskPaths, shape: ModelShape) -> dict[str, Any]:
    """The weights the run's actor started from (model.path), at this rank's layout and under the actor's state-dict
    keys (collective): what the anchor actions restore when the best checkpoint is the start. Under LoRA its adapters
    alone, as `apply_lora` built them (the same seed: A as drawn, B zero)."""
    model = cfg.model.build(path=paths.model_path, shape=shape, sequence_parallel=_sequence_parallel(cfg, shape))
    if not cfg.model.lora.enabled:
        return model.state_dict()
    apply_lora(model, cfg.model.lora, seed=cfg.train.seed)
    return adapter_entries(model.state_dict())


def _pushes_cpu_weights_by_handle(cfg: ArmorConfig) -> bool:
    """Whether weight pushes send handles to the trainer's own CPU weights (rollout.weight_sync.payload
    per_tensor), which must then live in shared memory: those the push reads in place
    (`parameters_exported_as_views`). An offloaded trainer's cannot (a parked storage is freed in place, a
    shared one cannot be), so its weights are staged."""
    rollout = cfg.rollout
    if rollout.memory.offload_trainer or training_device().type != "cpu":
        return False
    return ROLLOUT_BACKENDS[rollout.backend].pushes_weights_by_handle(rollout)


def _teacher(cfg: ArmorConfig, paths: TaskPaths, student: ModelShape) -> TeacherScorer:
    """The teacher that scores every batch (collective): in the trainer's processes at the student's layout, or
    a scoring server (opd.teacher_url, or one the trainer starts at opd.teacher_tensor/pipeline_parallel_size)."""
    opd = cfg.opd
    teacher_shape = None
    if paths.teacher_path is not None:  # None: only a teacher_url was given
        teacher_shape = load_model_shape(paths.teacher_path)
        check_teacher_vocab(teacher_shape.vocab_size, student.vocab_size, f"opd.teacher_path {paths.teacher_path}")
    scoring = _scoring(cfg)  # as the student's
    if opd.teacher_url is None and opd.teacher_layout is None:
        model = cfg.model.build(path=paths.teacher_path, shape=teacher_shape)
        batching = _micro_batching(cfg)  # as the student's
        return InProcessTeacher(model, micro_batching=batching, scoring=scoring)
    launch = None
    if opd.teacher_layout is not None:
        check_parallel_layout(teacher_shape, *opd.teacher_layout)  # before any teacher process starts
        # at opd's layout on a free loopback port, scoring the student's micro-batches in the student's dtype
        launch = TeacherServerConfig(paths.teacher_path, *opd.teacher_layout, port=0,
                                     micro_batch_size=cfg.micro_batching.micro_batch_size,
                                     params_dtype=cfg.model.params_dtype)
    urls = opd.teacher_url.split(",") if opd.teacher_url else None
    return connect_remote_teacher(urls, student_vocab=student.vocab_size, temperature=scoring.temperature,
                                  launch=launch, log_dir=cfg.logging.run_dir)


def _update_gate(
    cfg: ArmorConfig, config: GateSettings | None, val_rows: list[PromptRow], val_scorer: SampleScorer,
    sampling: SamplingParams,
) -> InferenceGapGate | None:
    """The algorithm's post-update gate over held-out prompts, or None when it has none. Its advantages come
    from verifier rewards (mipu.md §3): `val_scorer`, the validation scorer, no overlong penalty (a multi-turn run's
    trajectory scorer: the gate measures the engine on trajectories, as it samples them)."""
    if config is None:
        return None
    return InferenceGapGate(config, val_rows, val_scorer, sampling, seed=cfg.train.seed, adv_eps=cfg.algorithm.adv_eps)


def _engine_site(cfg: ArmorConfig, paths: TaskPaths, pad_token_id: int, rank: int) -> EngineSite:
    """Where this rank's rollout engines are built (`RolloutConfig.build`: one engine for both policies with
    rollout.anchors.engine shared or model.lora.weight_sync adapter, which the actor samples through its adapter,
    `_actor`). In-process engines run where `_engine_placement` says; under train.routing_replay rollout the actor's
    engine records the experts it routes to; SGLang clients' routers log to the run directory."""
    return EngineSite(model_path=paths.model_path, ref_path=paths.ref_path, pad_token_id=pad_token_id, rank=rank,
                      placement=_engine_placement(cfg),
                      record_routes=REPLAY_MODES[cfg.train.routing_replay].engines_record,
                      log_dir=cfg.logging.run_dir, reference_engine=not cfg.model.lora.adapter_sync)


def _teacher_engine(cfg: ArmorConfig, paths: TaskPaths, pad_token_id: int) -> LocalEngine:
    """OPD's off-policy variant: an in-process engine of the teacher's HF checkpoint with the options of the
    actor's and reference's (backend local: config validation); it samples the training responses and is
    never synced, so it must load the teacher's weights itself."""
    if is_megatron_checkpoint(paths.teacher_path):
        raise ValueError(
            f"opd.rollouts teacher needs opd.teacher_path as an HF checkpoint, {paths.teacher_path} is a "
            f"Megatron checkpoint (the teacher's engine receives no weights): export it with `armor convert "
            f"megatron-to-hf`"
        )
    return cfg.rollout.local.build(model=paths.teacher_path, pad_token_id=pad_token_id, **_engine_placement(cfg))


def _engine_placement(cfg: ArmorConfig) -> dict:
    """Where in-process engines run: on the trainer's GPU in its parameter dtype when there is one (their
    logprobs are still computed in float32), else on the CPU in float32."""
    device = training_device()
    if device.type != "cuda":
        return {}
    return {"device": device, "dtype": PARAMS_DTYPES[cfg.model.params_dtype]}
