"""Writing trainer checkpoints (trainer/checkpointing/checkpoint.py's layout), synchronously or overlapped with
training.

`CheckpointSaver.save` plans the Megatron distributed save (collective), then writes this rank's shards:
at once, or with `async_save` in a background thread while training goes on. The checkpoint is finalized
(Megatron's global metadata, trainer_state.json, COMPLETE marker, rename into place) only once every rank's
write is done: at the start of the next save, or in `finalize()`, which the run calls before it ends. A
process killed mid-save leaves only `.tmp_step_N/`, which nothing loads.

Asynchronous on CPU: Megatron's own async path (`AsyncCallsQueue`) forks a writer process and synchronises it
with CUDA tensors; here the request Megatron returns is written by a thread of the training process instead,
after the shards were copied (host memory: one more copy of this rank's state while the write runs). File I/O
releases the GIL, so the write overlaps the next steps' rollouts and updates.

Test hook: the environment variable ARMOR_CHECKPOINT_STALL_AT_STEP=N makes every rank stop (sleep) after
writing its shards of step N, before the checkpoint is finalized: a test kills the run there.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

from megatron_armor.config import CheckpointConfig
from megatron_armor.config.builders import builds
from megatron_armor.trainer.checkpointing.best_checkpoint import BestCheckpoint
from megatron_armor.trainer.checkpointing.checkpoint import (
    STATE_DIR, barrier, checkpoint_root, process_rank, publish, shared_record, step_dirs,
)
from megatron_armor.trainer.checkpointing.dist_state_io import plan_save, start_write
from megatron_armor.trainer.checkpointing.rng_state import rng_sharded_object

STALL_ENV = "ARMOR_CHECKPOINT_STALL_AT_STEP"


@dataclass
class _PendingSave:
    """A checkpoint whose shards are being written: what finalizing it needs."""

    step: int
    wait: Callable[[], None]
    request: AsyncRequest
    tmp: Path
    final: Path
    record: dict[str, Any]


class CheckpointSaver:
    """Saves trainer states of one run directory; at most one save is in flight (collective methods)."""

    def __init__(
        self, run_dir: str | Path, *, keep_last: int = 0, async_save: bool = False, best: BestCheckpoint | None = None,
    ):
        """`best`: the run's best checkpoint (checkpoint.keep_best), never pruned and named in checkpoints/BEST."""
        self.root, self.keep_last, self.async_save, self.best = checkpoint_root(run_dir), keep_last, async_save, best
        self.pending: _PendingSave | None = None

    def save(self, step: int, state: dict[str, Any], write_extra: Callable[[Path], None] | None = None) -> Path:
        """Save a trainer `state` (`RLTrainer.sharded_state_dict()`) as step `step`, after finalizing the save
        in flight. `write_extra(directory)`, called on every rank first, adds more to the checkpoint (e.g. the
        model in another format). Returns the final directory: complete on return unless `async_save`."""
        self.finalize()
        final, tmp = step_dirs(self.root, step)
        if process_rank() == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / STATE_DIR).mkdir(parents=True)
        barrier()
        if write_extra is not None:
            write_extra(tmp)
        request = plan_save({"modules": state["modules"], "rng": rng_sharded_object()}, tmp / STATE_DIR)
        wait = start_write(request, background=self.async_save)
        self.pending = _PendingSave(step, wait, request, tmp, final, shared_record(step, state))
        if not self.async_save:
            self.finalize()
        return final

    def finalize(self) -> None:
        """Wait for the save in flight on every rank, then publish it (nothing in flight: nothing to do)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        pending.wait()
        _stall_if_asked(pending.step)
        barrier()
        for finalize_fn in pending.request.finalize_fns:  # Megatron's global metadata (collective)
            finalize_fn()
        publish(pending.tmp, pending.final, pending.record, keep_last=self.keep_last, best=self.best)


@builds(CheckpointConfig)
def checkpoint_saver(settings: CheckpointConfig, *, run_dir: str | Path) -> CheckpointSaver:
    """The saver of the run in `run_dir` as the checkpoint section says (keep_last, async_save), with the run's
    `BestCheckpoint` (its `best`) when checkpoint.keep_best names a metric."""
    best = BestCheckpoint(settings) if settings.keep_best is not None else None
    return CheckpointSaver(run_dir, keep_last=settings.keep_last, async_save=settings.async_save, best=best)


def save_checkpoint(run_dir: str | Path, step: int, state: dict[str, Any], *, keep_last: int = 0,
                    write_extra: Callable[[Path], None] | None = None) -> Path:
    """Save `state` as step `step` synchronously (collective); returns the complete checkpoint's directory."""
    return CheckpointSaver(run_dir, keep_last=keep_last).save(step, state, write_extra)


def _stall_if_asked(step: int) -> None:
    if os.environ.get(STALL_ENV) == str(step):
        time.sleep(3600)

