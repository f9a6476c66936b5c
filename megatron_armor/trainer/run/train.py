"""`armor train`: set up a run from an `ArmorConfig` (trainer/run/build.py) and run the RL loop."""

from __future__ import annotations

import functools
import logging
import sys
import traceback
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist
from tqdm import tqdm

from megatron_armor.algorithms import TEACHER, Algorithm, build_algorithm
from megatron_armor.config import ArmorConfig, save_config
from megatron_armor.convert.megatron_checkpoint import is_megatron_checkpoint, save_model_checkpoint
from megatron_armor.convert.peft_export import PEFT_DIR, save_peft_adapter
from megatron_armor.distributed.init import DistributedContext, destroy_distributed
from megatron_armor.monitor import CollapseAlarmError
from megatron_armor.trainer.checkpointing.best_checkpoint import BestCheckpoint
from megatron_armor.trainer.checkpointing.checkpoint import guard_run_dir, load_checkpoint, saved_modules
from megatron_armor.trainer.checkpointing.checkpoint_save import CheckpointSaver
from megatron_armor.trainer.checkpointing.lora_base import LoRABase
from megatron_armor.trainer.guard.anchor_switch import AnchorSwitch
from megatron_armor.trainer.guard.adapter_reset import AdapterReset
from megatron_armor.trainer.guard.reference_reset import ReferenceReset
from megatron_armor.trainer.guard.run_guard import RunGuard
from megatron_armor.trainer.run.build import TrainingSetup, build_training, start_weights
from megatron_armor.trainer.run.task_setup import TaskPaths, prepare_task
from megatron_armor.trainer.step.loop import RLTrainer
from megatron_armor.trainer.step_inputs.policies import Policy, PolicyHandles
from megatron_armor.trainer.update.faults import TooManySkipsError
from megatron_armor.utils.extras import detect_gpu_extras
from megatron_armor.utils.metrics import MetricsLogger
from megatron_armor.utils.plotting import plot_metrics

log = logging.getLogger("megatron_armor")


class RunTracker(Protocol):
    """Run-level state beside the trainer's that every checkpoint carries (the collapse monitor, the best checkpoint,
    the anchor action's record)."""

    def state(self) -> dict[str, Any]: ...

    def load(self, state: dict[str, Any]) -> None: ...


def run_training(cfg: ArmorConfig, *, resume: bool = False, overwrite: bool = False) -> int:
    """Entry point of `armor train` on every rank; returns the process exit code."""
    try:
        ctx = cfg.parallel.build(seed=cfg.train.seed)
    except ValueError as error:  # a layout that does not fit the launched processes
        print(f"error: {error}", file=sys.stderr)
        destroy_distributed()
        return 2
    _configure_logging(ctx)
    try:
        train(ctx, cfg, resume=resume, overwrite=overwrite)
        return 0
    except Exception as error:  # report which rank failed, then let torchrun tear the job down
        log.error("%s failed: %s: %s\n%s", ctx.describe(), type(error).__name__, error, traceback.format_exc())
        return 1
    finally:
        destroy_distributed()


def train(ctx: DistributedContext, cfg: ArmorConfig, *, resume: bool, overwrite: bool) -> None:
    """The run on this rank (collective): load the reward functions, set up, resume, give the engines their first
    weights, then step, validate, watch for collapse, log and checkpoint until train.max_steps; tear down. After
    train.max_consecutive_skips skipped updates in a row (non-finite loss or gradients) it checkpoints the last good
    state and raises `TooManySkipsError`; on a collapse-monitor alarm whose action is stop it checkpoints and raises
    `CollapseAlarmError`; on one whose action is anchor it restarts as ARMOR from the best checkpoint, on anchor_keep
    it goes on as ARMOR with the best checkpoint as the reference (trainer/guard/anchor_switch.py)."""
    algorithm = build_algorithm(cfg)
    rewards = cfg.reward.build()  # a missing module, file or function fails before any model loads
    run_dir = Path(cfg.logging.run_dir)
    resume_from = guard_run_dir(run_dir, resume=resume, overwrite=overwrite)
    paths = _prepare_run(ctx, cfg, algorithm, run_dir)
    setup = build_training(ctx, cfg, algorithm, paths, rewards)
    trainer = setup.trainer
    saver = cfg.checkpoint.build(run_dir=run_dir)
    best = saver.best
    guard = _guard(ctx, cfg, setup, paths, best, saver)
    # a LoRA run's checkpoints name the base their adapters belong to; a resume on another base is refused
    trackers = [*guard.trackers, *([LoRABase.of(paths.model_path)] if cfg.model.lora.enabled else [])]
    start_step, ref_restored = (_resume(trainer, trackers, resume_from, cfg, paths) if resume_from is not None
                                else (0, False))
    trainer.push_initial_weights(_stale_policies(setup.models, paths, resumed=resume_from is not None,
                                                 ref_restored=ref_restored, adapter_sync=cfg.model.lora.adapter_sync))
    metrics_log = cfg.logging.build(enabled=ctx.is_main,
                                    resume_from_step=start_step if resume_from is not None else None)
    validate = functools.partial(_validate, ctx, cfg, setup)
    if start_step == 0 and cfg.eval.before_train:
        initial = validate(0)
        guard.observe_start(initial, Path(paths.model_path), saver.root, is_main=ctx.is_main)
        metrics_log.log(0, initial)
    progress = tqdm(
        range(start_step, cfg.train.max_steps), initial=start_step, total=cfg.train.max_steps,
        desc=algorithm.name.upper(), disable=not (ctx.is_main and cfg.logging.progress_bar), dynamic_ncols=True,
    )
    for step in progress:
        metrics = trainer.step(step)
        done = step + 1
        if cfg.eval.every and done % cfg.eval.every == 0:
            metrics.update(validate(done))
        verdict, anchored = guard.observe(done, metrics)
        alarms = verdict.stopping
        limit = cfg.train.max_consecutive_skips
        stop = bool(limit) and trainer.consecutive_skips >= limit
        saving = stop or alarms or done % cfg.checkpoint.every == 0 or done == cfg.train.max_steps
        if saving and best is not None and not anchored and best.improved_by(metrics):  # anchored: not these weights
            best.choose(done, metrics)  # before the save: the checkpoint carries the choice
        metrics_log.log(done, metrics)
        progress.set_postfix(reward=f"{metrics['train/reward_mean']:.2f}", clip=f"{metrics.get('loss/clip_fraction', 0):.3f}")
        if saving:
            checkpoint = _save(saver, trainer, trackers, setup.models, cfg, paths, done)
        if stop or alarms:
            _finish(trainer, saver, metrics_log)
            raise (TooManySkipsError(done, trainer.consecutive_skips, limit, checkpoint) if stop
                   else CollapseAlarmError(done, alarms, checkpoint))
    _finish(trainer, saver, metrics_log)
    _teardown(ctx, cfg, setup.models, run_dir)


def _guard(
    ctx: DistributedContext, cfg: ArmorConfig, setup: TrainingSetup, paths: TaskPaths, best: BestCheckpoint | None,
    saver: CheckpointSaver,
) -> RunGuard:
    """The run's collapse guard: the watch (on by default when the run validates), the anchor actions restoring
    `best` (the start's weights read again from model.path when it is the best) when an alarm's action is anchor or
    anchor_keep, the reference reset with monitor.reference_reset while the monitor runs, and under LoRA with
    algorithm.ref_reset_period the adapters' reset to `best`."""
    watch = cfg.monitor.build(validates=setup.validation.validates, is_main=ctx.is_main)
    start = functools.partial(start_weights, cfg, paths, setup.models.shape)
    anchor = (AnchorSwitch(cfg, setup.trainer, best, saver, watch, start, is_main=ctx.is_main)
              if cfg.monitor.anchors and best is not None else None)
    reset = (ReferenceReset(setup.trainer, watch, is_main=ctx.is_main)
             if cfg.monitor.reference_reset and watch.monitor is not None else None)  # the monitor judges health
    adapter_reset = (AdapterReset(setup.trainer, best, saver, start, is_main=ctx.is_main)
                     if cfg.model.lora.enabled and cfg.algorithm.ref_reset_period and best is not None else None)
    return RunGuard(watch, best, anchor, reset, adapter_reset)


def _finish(trainer: RLTrainer, saver: CheckpointSaver, metrics_log: MetricsLogger) -> None:
    """End the run's background work: the trainer's (rollouts generating ahead), an asynchronous save still in flight
    (finalized even when closing the trainer fails), the metrics files."""
    try:
        trainer.close()
    finally:
        saver.finalize()
        metrics_log.close()


def _prepare_run(ctx: DistributedContext, cfg: ArmorConfig, algorithm: Algorithm, run_dir: Path) -> TaskPaths:
    """The task's files (prepared once), the run directory with the run's config in it, and a log line."""
    paths = prepare_task(cfg, is_main=ctx.is_main, needs_teacher=algorithm.sources.uses(TEACHER))
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    log.info(
        "%s from %s: tp %d x pp %d x dp %d, rollouts: %s, run dir %s; GPU extras: %s", algorithm.name,
        paths.model_path, ctx.tp_size, ctx.pp_size, ctx.dp_size, cfg.rollout.backend, run_dir,
        detect_gpu_extras().describe(),
    )
    return paths


def _resume(
    trainer: RLTrainer, trackers: list[RunTracker], checkpoint: Path, cfg: ArmorConfig, paths: TaskPaths,
) -> tuple[int, bool]:
    """Restore the trainer, the run's trackers (collapse monitor, best checkpoint) and the RNG states from
    `checkpoint` (collective); returns the step to continue from and whether the reference came from the
    checkpoint (then not from model.ref_path)."""
    request = trainer.sharded_state_dict(is_loading=True, names=saved_modules(checkpoint))
    step, state = load_checkpoint(checkpoint, request, seed=cfg.train.seed)
    try:
        ref_restored = trainer.load_state_dict(state)
    except ValueError as error:
        raise ValueError(f"{checkpoint}: {error}") from error
    for tracker in trackers:
        tracker.load(state)
    if ref_restored:
        log.info("reference policy restored from %s (not from %s)", checkpoint, paths.ref_path)
    log.info("resumed from %s (step %d)", checkpoint, step)
    if step >= cfg.train.max_steps:
        log.warning("resumed at step %d but train.max_steps is %d: no step is left to run (max_steps counts "
                    "from step 0; raise it to continue training)", step, cfg.train.max_steps)
    return step, ref_restored


def _stale_policies(models: PolicyHandles, paths: TaskPaths, *, resumed: bool, ref_restored: bool,
                    adapter_sync: bool = False) -> list[Policy]:
    """The policies whose engines may not hold their weights at the start (actor, reference), to push them.

    Engines start from the HF checkpoint on disk, or without weights (remote servers may hold anything; a
    local engine for a Megatron checkpoint is built from its config). A shared engine gets the reference's
    weights before its first anchor phase. Under model.lora.weight_sync adapter (`adapter_sync`) the reference is
    the base the engine holds, and the actor's adapter is in no engine before its first push.
    """
    remote_engines = models.actor.engine.shared_across_ranks
    actor = resumed or remote_engines or is_megatron_checkpoint(paths.model_path) or adapter_sync
    ref_stale = remote_engines or is_megatron_checkpoint(paths.ref_path) or ref_restored
    stale = {models.actor: actor, models.ref: not models.shared_engine and ref_stale}
    return [policy for policy, is_stale in stale.items() if is_stale]


def _validate(ctx: DistributedContext, cfg: ArmorConfig, setup: TrainingSetup, step: int) -> dict[str, float]:
    """Validation metrics of the actor's engine after `step` steps (trainer/step/validation.py; {} without validation
    prompts; collective)."""
    result = setup.validation.run(setup.models.actor.engine, seed=(cfg.train.seed, step, "val"))
    if result and ctx.is_main:
        accuracies = ", ".join(f"{key} = {value:.3f}" for key, value in result.items()
                               if key == "val/accuracy" or key.startswith("val/accuracy_") and key != "val/accuracy_stderr")
        tqdm.write(f"step {step}: {accuracies}")
    return result


def _save(
    saver: CheckpointSaver, trainer: RLTrainer, trackers: list[RunTracker], models: PolicyHandles, cfg: ArmorConfig,
    paths: TaskPaths, step: int,
) -> Path:
    """Checkpoint the trainer (and the run's trackers' state beside its entries) after `step` steps
    (collective; with checkpoint.async_save its shards are still being written on return), with the actor as a
    Megatron distributed checkpoint beside it when checkpoint.save_model (`model/`) and a LoRA run's adapters in
    PEFT's format when checkpoint.save_peft (`peft/`); returns its directory."""
    save_peft = cfg.model.lora.enabled and cfg.checkpoint.save_peft

    def export(checkpoint_dir: Path) -> None:
        if cfg.checkpoint.save_model:
            save_model_checkpoint(models.actor.module, models.shape, checkpoint_dir / "model",
                                  side_files_from=paths.model_path)
        if save_peft:
            save_peft_adapter(models.actor.module, models.shape, cfg.model.lora, checkpoint_dir / PEFT_DIR,
                              base_model=str(paths.model_path))

    with trainer.state_resident():
        tracked = {key: value for tracker in trackers for key, value in tracker.state().items()}
        return saver.save(step, {**trainer.sharded_state_dict(), **tracked},
                          write_extra=export if cfg.checkpoint.save_model or save_peft else None)


def _teardown(ctx: DistributedContext, cfg: ArmorConfig, models: PolicyHandles, run_dir: Path) -> None:
    """Close the engines (e.g. leave the servers' weight-update group) and a teacher server the trainer started,
    plot the curves (collective)."""
    for engine in models.engines():
        engine.close()
    if models.teacher is not None:
        models.teacher.scorer.close()
    if ctx.is_main and cfg.logging.plot:
        plot_metrics(run_dir / "metrics.jsonl", run_dir / "curves.png")
        log.info("run directory %s: metrics.jsonl, curves.png, checkpoints/", run_dir)
    dist.barrier()


def _configure_logging(ctx: DistributedContext) -> None:
    logging.basicConfig(
        level=logging.INFO if ctx.is_main else logging.WARNING,
        format=f"%(asctime)s [rank {ctx.rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
