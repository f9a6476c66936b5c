"""`armor train`: build every component from an `ArmorConfig` and run the RL loop."""

from __future__ import annotations

import contextlib
import itertools
import logging
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM

from megatron_armor.config import ArmorConfig, RolloutConfig, save_config
from megatron_armor.diagnostics.subspace import SubspaceConstraint
from megatron_armor.convert.megatron_checkpoint import is_megatron_checkpoint, save_model_checkpoint
from megatron_armor.convert.weights import parameters_exported_as_views
from megatron_armor.data.datasets import PromptRow, PromptSampler, check_tokenizer_fits_model, load_prompt_rows
from megatron_armor.distributed.device import training_device
from megatron_armor.distributed.init import DistributedContext, destroy_distributed, initialize_distributed
from megatron_armor.models.hf_config import ModelShape, check_parallel_layout, load_model_shape
from megatron_armor.convert.loading import PARAMS_DTYPES, load_gpt_model
from megatron_armor.models.tokenizer import load_tokenizer
from megatron_armor.rewards.registry import load_reward_fn
from megatron_armor.rollout.base import RolloutEngine, SamplingParams
from megatron_armor.rollout.local import LocalEngine
from megatron_armor.rollout.tensor_serialization import share_storages
from megatron_armor.teacher.scorer import InProcessTeacher, TeacherScorer, check_teacher_vocab, connect_remote_teacher
from megatron_armor.teacher.serve_cli import TeacherServerSettings
from megatron_armor.trainer.anchor_cache import AnchorCache
from megatron_armor.trainer.checkpoint import TrainerState, guard_run_dir, load_checkpoint, save_checkpoint
from megatron_armor.scoring.logprobs import ScoringSettings, resolve_logprob_head
from megatron_armor.trainer.memory_handoff import MemoryHandoff
from megatron_armor.trainer.loop import PolicyHandles, RLTrainer, StepPlan, evaluate
from megatron_armor.trainer.mipu_gate import GateSettings, InferenceGapGate
from megatron_armor.trainer.offload import TrainerOffload
from megatron_armor.trainer.optimizer import OptimizerSettings, subspace_constraint, wrap_for_training
from megatron_armor.trainer.policy_update import LossSettings, SamplerCorrection
from megatron_armor.trainer.rollout_stage import OverlongPenalty, SampleScorer
from megatron_armor.trainer.task_setup import TaskPaths, prepare_task
from megatron_armor.utils.extras import detect_gpu_extras
from megatron_armor.utils.metrics import MetricsLogger
from megatron_armor.utils.plotting import plot_metrics

log = logging.getLogger("megatron_armor")


def run_training(cfg: ArmorConfig, *, resume: bool = False, overwrite: bool = False) -> int:
    """Entry point of `armor train` on every rank; returns the process exit code."""
    layout = cfg.parallel
    try:
        ctx = initialize_distributed(
            layout.tensor_parallel_size, layout.pipeline_parallel_size, layout.data_parallel_size, seed=cfg.train.seed
        )
    except ValueError as error:  # a layout that does not fit the launched processes
        print(f"error: {error}", file=sys.stderr)
        destroy_distributed()
        return 2
    _configure_logging(ctx)
    try:
        _train(ctx, cfg, resume=resume, overwrite=overwrite)
        return 0
    except Exception as error:  # report which rank failed, then let torchrun tear the job down
        log.error("%s failed: %s: %s\n%s", ctx.describe(), type(error).__name__, error, traceback.format_exc())
        return 1
    finally:
        destroy_distributed()


@dataclass
class TrainingSetup:
    """Everything `_train` runs: the trainer and what validation and checkpoints need besides it."""

    trainer: RLTrainer
    modules: dict[str, Any]  # checkpointed state_dict owners (the reference joins them when it leaves model.ref_path)
    val_rows: list[PromptRow]
    val_scorer: SampleScorer
    val_sampling: SamplingParams


def context_length_warning(cfg: ArmorConfig, shape: ModelShape) -> str | None:
    """Why SGLang servers would refuse the run's longest requests, or None."""
    positions = cfg.data.max_prompt_length + cfg.rollout.sampling.max_new_tokens
    if positions <= shape.max_position_embeddings:
        return None
    return (f"data.max_prompt_length + rollout.sampling.max_new_tokens = {positions} positions, but the model's "
            f"config.json says max_position_embeddings {shape.max_position_embeddings}: SGLang servers refuse longer "
            f"requests unless started with --context-length (or the config raises it)")


def build_training(ctx: DistributedContext, cfg: ArmorConfig, paths: TaskPaths) -> TrainingSetup:
    """Models, engines, data, scorers and the `RLTrainer` of this rank, as `cfg` says (collective)."""
    tokenizer = load_tokenizer(paths.model_path)
    shape = load_model_shape(paths.model_path)
    check_tokenizer_fits_model(tokenizer, shape.vocab_size)
    if (warning := context_length_warning(cfg, shape)) and ctx.is_main:
        log.warning("%s (%s)", warning, paths.model_path)
    algorithm = cfg.algorithm
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    actor_engine, ref_engine = _rollout_engines(cfg, paths, pad_token_id)
    teacher_engine = _teacher_engine(cfg, paths, pad_token_id) if cfg.opd.rollouts == "teacher" else None
    handoff = MemoryHandoff([actor_engine, ref_engine]) if cfg.rollout.memory.release_servers else None
    if handoff is not None and ref_engine is not actor_engine and not ref_engine.keeps_weights_across_release():
        raise ValueError(
            "rollout.memory.release_servers with separate reference servers (rollout.sglang.ref_urls) needs them "
            "started with --enable-weights-cpu-backup: their weights are pushed once, not after every release, and "
            "SGLang's memory saver loses them otherwise (armor ray-train --placement colocated starts them so)"
        )
    optim = OptimizerSettings(
        lr=cfg.train.lr, warmup_steps=cfg.train.warmup_steps, weight_decay=cfg.train.weight_decay,
        adam_beta1=cfg.train.adam_beta1, adam_beta2=cfg.train.adam_beta2, adam_eps=cfg.train.adam_eps,
        grad_clip=cfg.train.grad_clip,
    )
    models = _build_models(cfg, paths, shape, optim, handoff, (actor_engine, ref_engine))
    ddp, optimizer, ref, teacher = models.ddp, models.optimizer, models.ref, models.teacher

    stop_ids = (tokenizer.eos_token_id,)
    sampling = SamplingParams(
        temperature=cfg.rollout.sampling.temperature, top_p=cfg.rollout.sampling.top_p,
        max_new_tokens=cfg.rollout.sampling.max_new_tokens, stop_token_ids=stop_ids,
    )
    val_sampling = SamplingParams(
        temperature=cfg.rollout.sampling.val_temperature, top_p=cfg.rollout.sampling.val_top_p,
        max_new_tokens=cfg.rollout.sampling.max_new_tokens, stop_token_ids=stop_ids,
    )
    handles = PolicyHandles(
        actor=ddp, optimizer=optimizer, ref=ref, shape=shape, actor_engine=actor_engine, ref_engine=ref_engine,
        pad_token_id=pad_token_id, teacher=teacher, teacher_engine=teacher_engine,
    )
    row_options = dict(
        prompt_key=cfg.data.prompt_key, answer_key=cfg.data.answer_key, tokenizer=tokenizer,
        apply_chat_template=cfg.data.apply_chat_template, max_prompt_length=cfg.data.max_prompt_length,
    )
    train_rows = load_prompt_rows(paths.train_path, **row_options)
    all_val_rows = load_prompt_rows(paths.val_path, **row_options) if paths.val_path else []
    sampler = PromptSampler(train_rows, cfg.train.gen_batch_size, seed=cfg.train.seed, shuffle=cfg.data.shuffle)
    overlong = OverlongPenalty(cfg.rollout.sampling.max_new_tokens, cfg.reward.overlong_buffer,
                               cfg.reward.overlong_factor)
    train_scorer = SampleScorer(tokenizer, load_reward_fn(cfg.reward.train_fn), overlong)
    val_scorer = SampleScorer(tokenizer, load_reward_fn(cfg.reward.val_fn or cfg.reward.train_fn))

    kl_coef = cfg.kl.coef if algorithm.name in ("grpo_kl", "mipu") else 0.0  # mipu.md §2: 1e-3 KL loss
    plan = StepPlan(
        algorithm=algorithm.name, train_batch_size=cfg.train.train_batch_size, mini_batch_size=cfg.train.mini_batch_size,
        micro_batch_size=cfg.train.micro_batch_size, actor_n=cfg.rollout.sampling.actor_n,
        ref_n=cfg.rollout.anchors.ref_n,
        filter_groups=algorithm.filter_groups and algorithm.name != "opd",  # OPD learns from every prompt
        max_num_gen_batches=algorithm.max_num_gen_batches,
        allow_partial_batch=algorithm.allow_partial_batch, adv_eps=algorithm.adv_eps,
        advantage_baseline=algorithm.advantage_baseline, baseline_quantile=algorithm.baseline_quantile,
        ref_reset_period=algorithm.ref_reset_period, seed=cfg.train.seed, opd_beta=cfg.opd.beta,
        opd_alpha=cfg.opd.alpha, opd_token_fraction=cfg.opd.token_fraction,
        opd_token_selection=cfg.opd.token_selection, kl_coef=kl_coef,
    )
    mipu = algorithm.name == "mipu"
    loss = LossSettings(
        alpha=cfg.armor.alpha if algorithm.name == "armor" else 1.0, clip_low=algorithm.clip_low,
        clip_high=algorithm.effective_clip_high, dual_clip=algorithm.effective_dual_clip,
        kl_coef=kl_coef, kl_estimator=cfg.kl.estimator,
        temperature=cfg.rollout.sampling.temperature, logprob_head=resolve_logprob_head(cfg.train.logprob_head),
        sampler=SamplerCorrection(cfg.mipu.is_correction, cfg.mipu.w_max) if mipu else None,
        aggregation=algorithm.aggregation,
    )
    # The gate's advantages come from verifier rewards (mipu.md §3): the validation scorer, no overlong penalty.
    gate = _mipu_gate(cfg, all_val_rows, val_scorer, sampling) if mipu and cfg.mipu.gate else None
    constraint = models.constraint
    anchor_cache = AnchorCache(cfg.rollout.anchors.cache_max_prompts) if cfg.rollout.anchors.cache else None
    trainer = RLTrainer(ctx, handles, plan, sampler, sampling, train_scorer, loss, optim, gate=gate,
                        constraint=constraint, constraint_capture_step=cfg.train.subspace_capture_step,
                        anchor_cache=anchor_cache, memory_handoff=handoff, offload=models.offload)
    modules = {"actor": ddp, "optimizer": optimizer}
    if constraint is not None:
        modules["subspace"] = constraint
    return TrainingSetup(trainer=trainer, modules=modules, val_rows=all_val_rows[: cfg.eval.max_prompts],
                         val_scorer=val_scorer, val_sampling=val_sampling)


@dataclass
class TrainerModels:
    """A rank's models: the DDP-wrapped actor and its optimizer, the frozen reference, the OPD teacher, the
    subspace constraint over the actor's weights, and the offload of them all (rollout.memory.offload_trainer)."""

    ddp: torch.nn.Module
    optimizer: Any
    ref: torch.nn.Module
    teacher: TeacherScorer | None
    constraint: SubspaceConstraint | None
    offload: TrainerOffload | None


def _build_models(
    cfg: ArmorConfig, paths: TaskPaths, shape: ModelShape, optim: OptimizerSettings, handoff: MemoryHandoff | None,
    engines: tuple[RolloutEngine, RolloutEngine],
) -> TrainerModels:
    """The models of this rank (collective). Colocated, the servers release their GPU memory while the
    models are built (`handoff`), and an offloaded trainer parks them before the servers take it back
    (the servers get their weights from the first pushes, which bring the trainer's copy of each back
    for the push alone)."""
    dtype = PARAMS_DTYPES[cfg.model.params_dtype]
    with handoff.training_phase() if handoff else contextlib.nullcontext():
        ddp, optimizer = wrap_for_training(load_gpt_model(paths.model_path, shape, params_dtype=dtype, trainable=True),
                                           optim)
        ref = load_gpt_model(paths.ref_path, shape, params_dtype=dtype)
        teacher = _opd_teacher(cfg, paths, shape) if cfg.algorithm.name == "opd" else None
        constraint = (subspace_constraint(ddp.module, cfg.train.subspace_k, cfg.train.subspace_mode)
                      if cfg.train.subspace_capture_step else None)
        offload = None
        if cfg.rollout.memory.offload_trainer:
            frozen = {"ref": ref, **({"teacher": teacher.model} if isinstance(teacher, InProcessTeacher) else {})}
            offload = TrainerOffload(ddp, optimizer, frozen, constraint)
            offload.park()
        elif _pushes_cpu_weights_by_handle(cfg):  # the models this rank pushes to servers (engines: actor, ref)
            pushed = [module for module, engine in zip((ddp.module, ref), engines) if engine.pushes_weights]
            moved = share_storages(itertools.chain.from_iterable(parameters_exported_as_views(m, shape) for m in pushed))
            if pushed:
                log.info("weights in shared memory for per-tensor pushes: %.1f MiB", moved / 2**20)
    return TrainerModels(ddp, optimizer, ref, teacher, constraint, offload)


def _pushes_cpu_weights_by_handle(cfg: ArmorConfig) -> bool:
    """Whether weight pushes send handles to the trainer's own CPU weights (rollout.weight_sync.payload
    per_tensor), which must then live in shared memory: those the push reads in place
    (`parameters_exported_as_views`). An offloaded trainer's cannot (a parked storage is freed in place, a
    shared one cannot be), so its weights are staged."""
    r = cfg.rollout
    return r.backend == "sglang" and _pushes_per_tensor(r) and training_device().type == "cpu" and not r.offload_trainer


def _pushes_per_tensor(rollout: RolloutConfig) -> bool:
    """rollout.weight_sync.method tensor with SGLang's load_format null (payload per_tensor); the other update
    paths send flattened buckets."""
    return rollout.weight_sync.method == "tensor" and rollout.weight_sync.payload == "per_tensor"


def _opd_teacher(cfg: ArmorConfig, paths: TaskPaths, student: ModelShape) -> TeacherScorer:
    """The OPD teacher (collective): in the trainer's processes at the student's layout, or a scoring server
    (opd.teacher_url, or one the trainer starts at opd.teacher_tensor/pipeline_parallel_size)."""
    m, o = cfg.model, cfg.opd
    teacher_shape = None
    if paths.teacher_path is not None:  # None: only a teacher_url was given
        teacher_shape = load_model_shape(paths.teacher_path)
        check_teacher_vocab(teacher_shape.vocab_size, student.vocab_size, f"opd.teacher_path {paths.teacher_path}")
    scoring = ScoringSettings(temperature=cfg.rollout.sampling.temperature,  # as the student's
                              head=resolve_logprob_head(cfg.train.logprob_head))
    if o.teacher_url is None and o.teacher_layout is None:
        model = load_gpt_model(paths.teacher_path, teacher_shape, params_dtype=PARAMS_DTYPES[m.params_dtype])
        return InProcessTeacher(model, micro_batch_size=cfg.train.micro_batch_size, scoring=scoring)
    launch = None
    if o.teacher_layout is not None:
        tp, pp = o.teacher_layout
        check_parallel_layout(teacher_shape, tp, pp)  # before any teacher process starts
        launch = TeacherServerSettings(paths.teacher_path, tp, pp, port=0, micro_batch_size=cfg.train.micro_batch_size,
                                       params_dtype=m.params_dtype)
    urls = o.teacher_url.split(",") if o.teacher_url else None
    return connect_remote_teacher(urls, student_vocab=student.vocab_size, temperature=scoring.temperature,
                                  launch=launch, log_dir=cfg.logging.run_dir)


def _mipu_gate(
    cfg: ArmorConfig, val_rows: list[PromptRow], scorer: SampleScorer, sampling: SamplingParams
) -> InferenceGapGate:
    """MIPU Step 2 over held-out prompts: its own resumable sampler over the validation rows."""
    m = cfg.mipu
    if len(val_rows) < m.gate_prompts:
        raise ValueError(
            f"mipu.gate needs mipu.gate_prompts ({m.gate_prompts}) held-out prompts, the "
            f"validation set ({cfg.data.val_path or 'synthetic'}) has {len(val_rows)}; set data.val_path, lower "
            f"mipu.gate_prompts, or set mipu.gate=false"
        )
    settings = GateSettings(c_start=m.c_start, c_end=m.c_end, ramp_steps=m.ramp_steps,
                            prompts=m.gate_prompts, n=m.gate_n)
    prompts = PromptSampler(val_rows, m.gate_prompts, seed=cfg.train.seed + 1)
    return InferenceGapGate(settings, prompts, scorer, sampling, seed=cfg.train.seed, adv_eps=cfg.algorithm.adv_eps)


def _train(ctx: DistributedContext, cfg: ArmorConfig, *, resume: bool, overwrite: bool) -> None:
    run_dir = Path(cfg.logging.run_dir)
    resume_from = guard_run_dir(run_dir, resume=resume, overwrite=overwrite)
    paths = prepare_task(cfg, is_main=ctx.is_main)
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    log.info(
        "%s from %s: tp %d x pp %d x dp %d, rollouts: %s, run dir %s; GPU extras: %s", cfg.algorithm.name,
        paths.model_path, ctx.tp_size, ctx.pp_size, ctx.dp_size, cfg.rollout.backend, run_dir,
        detect_gpu_extras().describe(),
    )
    setup = build_training(ctx, cfg, paths)
    trainer, modules, handles, algorithm = setup.trainer, setup.modules, setup.trainer.h, cfg.algorithm
    sampler, gate = trainer.sampler, trainer.gate

    def export_model(checkpoint_dir: Path) -> None:
        if cfg.checkpoint.save_model:
            save_model_checkpoint(handles.actor.module, handles.shape, checkpoint_dir / "model",
                                  side_files_from=paths.model_path)

    start_step = 0
    ref_restored = False
    if resume_from is not None:
        # Offloaded, loading needs the whole state on the GPU: a trainer phase (the pushes below refill the servers).
        with trainer.trainer_phase() if trainer.offload else contextlib.nullcontext():
            state, restored = load_checkpoint(resume_from, modules, optional={"ref": handles.ref})
        ref_restored = "ref" in restored
        if ref_restored:
            log.info("reference policy restored from %s (not from %s)", resume_from, paths.ref_path)
        sampler.load_state_dict(state.sampler)
        trainer.optimizer_steps = state.extra["optimizer_steps"]
        if gate is not None:
            gate.load_state_dict(state.extra["mipu_gate"])
        if trainer.anchor_cache is not None and "anchor_cache" in state.extra:  # absent: saved with the cache off
            trainer.anchor_cache.load_state_dict(state.extra["anchor_cache"])
        start_step = state.step
        log.info("resumed from %s (step %d)", resume_from, start_step)
        if start_step >= cfg.train.max_steps:
            log.warning("resumed at step %d but train.max_steps is %d: no step is left to run (max_steps counts "
                        "from step 0; raise it to continue training)", start_step, cfg.train.max_steps)
    trainer.park_for_rollouts()  # offloaded: only the weights each push needs come back for it
    # Engines start from the HF checkpoint on disk, or without weights (remote servers may hold anything;
    # a local engine for a Megatron checkpoint is built from its config): push what the trainer holds.
    # A shared engine gets the reference's weights before its first anchor phase.
    remote_engines = handles.actor_engine.shared_across_ranks
    if resume_from is not None or remote_engines or is_megatron_checkpoint(paths.model_path):
        trainer.sync_actor_to_engine()
    ref_stale = remote_engines or is_megatron_checkpoint(paths.ref_path) or ref_restored
    if handles.ref_engine is not handles.actor_engine and ref_stale:
        trainer.sync_ref_to_engine()
    if algorithm.ref_reset_period or ref_restored:  # the reference is not (only) model.ref_path's: checkpoint it
        modules["ref"] = handles.ref

    metrics_log = MetricsLogger(
        run_dir, tensorboard=cfg.logging.tensorboard, wandb_project=cfg.logging.wandb_project, enabled=ctx.is_main,
        resume_from_step=start_step if resume_from is not None else None,
    )

    def run_eval(step: int) -> dict[str, float]:
        if not setup.val_rows:
            return {}
        result = evaluate(handles.actor_engine, setup.val_rows, setup.val_scorer, setup.val_sampling,
                          n=cfg.rollout.sampling.val_n, seed=(cfg.train.seed, step, "val"))
        if ctx.is_main:
            tqdm.write(f"step {step}: val/accuracy = {result['val/accuracy']:.3f}")
        return result

    if start_step == 0 and cfg.eval.before_train:
        metrics_log.log(0, run_eval(0))
    progress = tqdm(
        range(start_step, cfg.train.max_steps), initial=start_step, total=cfg.train.max_steps, desc="ARMOR" if
        algorithm.name == "armor" else algorithm.name.upper(), disable=not (ctx.is_main and cfg.logging.progress_bar),
        dynamic_ncols=True,
    )
    for step in progress:
        metrics = trainer.step(step)
        done = step + 1
        if cfg.eval.every and done % cfg.eval.every == 0:
            metrics.update(run_eval(done))
        metrics_log.log(done, metrics)
        progress.set_postfix(reward=f"{metrics['train/reward_mean']:.2f}", clip=f"{metrics.get('loss/clip_fraction', 0):.3f}")
        if done % cfg.checkpoint.every == 0 or done == cfg.train.max_steps:
            extra = {"optimizer_steps": trainer.optimizer_steps}
            if gate is not None:
                extra["mipu_gate"] = gate.state_dict()
            if trainer.anchor_cache is not None:
                extra["anchor_cache"] = trainer.anchor_cache.state_dict()
            state = TrainerState(step=done, sampler=sampler.state_dict(), extra=extra)
            with trainer.state_resident():
                save_checkpoint(run_dir, done, modules, state, keep_last=cfg.checkpoint.keep_last,
                                write_extra=export_model)
    metrics_log.close()
    engines = (handles.actor_engine, handles.ref_engine, handles.teacher_engine)
    for engine in {id(e): e for e in engines if e is not None}.values():
        engine.close()  # e.g. leaves the servers' weight-update group
    if handles.teacher is not None:
        handles.teacher.close()  # stops a teacher server the trainer started
    if ctx.is_main and cfg.logging.plot:
        plot_metrics(run_dir / "metrics.jsonl", run_dir / "curves.png")
        log.info("run directory %s: metrics.jsonl, curves.png, checkpoints/", run_dir)
    dist.barrier()


def _rollout_engines(cfg: ArmorConfig, paths, pad_token_id: int) -> tuple[RolloutEngine, RolloutEngine]:
    """(on-policy engine, anchor engine): in-process models on every rank, or clients of SGLang servers.

    The two are one object with rollout.anchors.engine shared (and for algorithms without anchors on
    SGLang). An SGLang engine starts from whatever its servers loaded; the trainer pushes the actor's
    (and, for ARMOR, the reference's) weights before the first rollout.
    """
    rollout = cfg.rollout
    if rollout.backend == "local":
        options = _local_engine_options(cfg, pad_token_id)
        actor = _local_engine(paths.model_path, **options)
        return actor, actor if rollout.anchors.engine == "shared" else _local_engine(paths.ref_path, **options)
    from megatron_armor.rollout.router import make_sglang_engine
    from megatron_armor.rollout.push_assignment import push_urls_of_this_rank
    from megatron_armor.rollout.sglang_engine import SGLangEngineConfig

    client = SGLangEngineConfig(bucket_bytes=rollout.weight_sync.bucket_mb << 20,
                                weight_sync=rollout.weight_sync.method,
                                weight_sync_dir=rollout.weight_sync.dir,
                                load_format=None if _pushes_per_tensor(rollout) else "flattened_bucket")
    log_dir = cfg.logging.run_dir  # routers' logs

    def engine(urls: str, router_url: str | None):
        push_urls = push_urls_of_this_rank(urls.split(","), rollout.weight_sync.method)  # collective
        return make_sglang_engine(urls, router_url, rollout, client, log_dir=log_dir, push_urls=push_urls)

    actor = engine(rollout.sglang.urls, rollout.sglang.router_url)
    ref = engine(rollout.sglang.ref_urls, rollout.sglang.ref_router_url) if rollout.sglang.ref_urls else actor
    return actor, ref


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
    return LocalEngine(paths.teacher_path, **_local_engine_options(cfg, pad_token_id))


def _local_engine_options(cfg: ArmorConfig, pad_token_id: int) -> dict[str, Any]:
    """Keyword arguments of every in-process engine of the run (`LocalEngine`)."""
    return dict(pad_token_id=pad_token_id, weight_precision=cfg.rollout.engine_precision)


def _local_engine(path: str, **options) -> LocalEngine:
    """An in-process engine for an HF checkpoint, or, for a Megatron checkpoint, an engine built from
    its (verbatim) HF config whose weights the trainer pushes before the first rollout."""
    if not is_megatron_checkpoint(path):
        return LocalEngine(path, **options)
    return LocalEngine(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32), **options)


def _configure_logging(ctx: DistributedContext) -> None:
    logging.basicConfig(
        level=logging.INFO if ctx.is_main else logging.WARNING,
        format=f"%(asctime)s [rank {ctx.rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
