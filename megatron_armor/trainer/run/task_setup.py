"""Resolve the run's model and data paths, creating the synthetic demo task when asked.

With `task.synthetic: arithmetic`, rank 0 creates (once, cached under `task.cache_dir`) a tiny
Qwen2 checkpoint, the arithmetic train/validation JSONL files, and a supervised warm start of the
model so that the reference policy already solves part of the task (ARMOR needs correct anchors).
For OPD without `opd.teacher_path` the warm start becomes the teacher and the untrained tiny
model the student. Every other rank waits and receives the same paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from megatron_armor.config import ArmorConfig, config_hash


@dataclass(frozen=True)
class TaskPaths:
    model_path: str
    ref_path: str
    train_path: str
    val_path: str | None
    teacher_path: str | None = None  # OPD teacher


def prepare_task(cfg: ArmorConfig, *, is_main: bool, needs_teacher: bool) -> TaskPaths:
    """Paths of policy/reference checkpoints and datasets; builds synthetic assets on rank 0. With
    `needs_teacher` (the algorithm scores with a teacher) and no opd.teacher_path, the synthetic task's warm
    start is the teacher and the untrained tiny model the student."""
    paths = [_prepare(cfg, needs_teacher) if is_main else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(paths, src=0)
    return paths[0]


def _prepare(cfg: ArmorConfig, needs_teacher: bool) -> TaskPaths:
    if cfg.task.synthetic is None:
        return TaskPaths(cfg.model.path, cfg.model.ref_path or cfg.model.path, cfg.data.train_path, cfg.data.val_path,
                         cfg.opd.teacher_path)
    if cfg.task.synthetic != "arithmetic":
        raise ValueError(f"task.synthetic: unknown task {cfg.task.synthetic!r}; available: 'arithmetic'")
    from megatron_armor.data.datasets import write_jsonl
    from megatron_armor.models.tiny import make_tiny_checkpoint
    from megatron_armor.rewards.arithmetic import make_rows

    cache = Path(cfg.task.cache_dir)
    task = cfg.task
    terms = dict(min_terms=task.min_terms, max_terms=task.max_terms)
    train_rows = make_rows(task.num_train_rows, seed=cfg.train.seed, **terms)
    val_rows = make_rows(task.num_val_rows, seed=cfg.train.seed + 1, **terms)
    data_dir = cache / f"arithmetic-{config_hash({'train': task.num_train_rows, 'val': task.num_val_rows, 'seed': cfg.train.seed, **terms})}"
    train_path, val_path = data_dir / "train.jsonl", data_dir / "val.jsonl"
    if not val_path.is_file():
        data_dir.mkdir(parents=True, exist_ok=True)
        write_jsonl(train_rows, train_path)
        write_jsonl(val_rows, val_path)
    model_path = Path(cfg.model.path) if cfg.model.path else cache / "tiny-qwen2"
    if not (model_path / "config.json").is_file():
        make_tiny_checkpoint(model_path, arch="qwen2", seed=cfg.train.seed)
    teacher_path = cfg.opd.teacher_path
    if cfg.task.warm_start.steps > 0:
        warm = _warm_start(model_path, train_rows, val_rows, cfg)
        if needs_teacher and teacher_path is None:
            teacher_path = str(warm)  # distil the warm start into the untrained model
        else:
            model_path = warm
    train = cfg.data.train_path or str(train_path)
    val = cfg.data.val_path or str(val_path)
    return TaskPaths(str(model_path), str(model_path), train, val, teacher_path)


def _warm_start(model_path: Path, train_rows: list[dict], val_rows: list[dict], cfg: ArmorConfig) -> Path:
    from megatron_armor.trainer.run.warmstart import Demonstrations, cached_warm_start

    result = cached_warm_start(model_path, train_rows, Path(cfg.task.cache_dir) / "warm-start", cfg.task.warm_start,
                               seed=cfg.train.seed, demonstrations=Demonstrations.load(cfg.rollout.agentic))
    return Path(result.path)
