"""Resumable training checkpoints: per-rank model/optimizer/RNG shards plus shared trainer state.

Layout under `<run_dir>/checkpoints/`:
    step_000010/rank_00000.pt ...   one file per rank: model shard, optimizer state, RNG states
    step_000010/trainer_state.json  step, data position, anything the loop needs to continue
    step_000010/model/              (optional) the actor as a Megatron distributed checkpoint that
                                    `armor convert megatron-to-hf` and `armor diagnose` read
    step_000010/COMPLETE            written last; a directory without it is never loaded
A checkpoint is written into `.tmp_step_000010/` and renamed into place only once every rank has
written, so a crash mid-save never leaves a directory that looks complete.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

COMPLETE_MARKER = "COMPLETE"


class CheckpointExistsError(RuntimeError):
    """A run directory already holds checkpoints and neither resume nor overwrite was requested."""


@dataclass
class TrainerState:
    """What the loop needs besides weights to continue exactly: the next step and data position."""

    step: int
    sampler: dict[str, Any]
    extra: dict[str, Any]


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.glob("step_*"):
        if (path / COMPLETE_MARKER).is_file():
            found.append((int(path.name.removeprefix("step_")), path))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    checkpoints = list_checkpoints(root)
    return checkpoints[-1][1] if checkpoints else None


def guard_run_dir(run_dir: str | Path, *, resume: bool, overwrite: bool) -> Path | None:
    """Decide what happens to existing checkpoints before training starts (call on every rank).

    Returns the checkpoint to resume from (None for a fresh start). Raises `CheckpointExistsError`
    when checkpoints exist and neither flag is given, so nothing is ever written over them silently.
    `overwrite` deletes the old checkpoints (rank 0), which is the only destructive path.
    """
    root = checkpoint_root(run_dir)
    latest = latest_checkpoint(root)
    if resume:
        return latest
    if latest is not None and not overwrite:
        raise CheckpointExistsError(
            f"{run_dir} already holds checkpoints (latest: {latest.name}); pass --resume to continue that run "
            f"or --overwrite to delete them and start over"
        )
    if overwrite and root.exists() and _rank() == 0:
        shutil.rmtree(root)
    _barrier()
    return None


def save_checkpoint(
    run_dir: str | Path, step: int, modules: dict[str, Any], state: TrainerState, *, keep_last: int = 0,
    write_extra: Callable[[Path], None] | None = None,
) -> Path:
    """Save `modules` (name -> object with state_dict(), e.g. model, optimizer) of every rank.

    `write_extra(directory)`, called on every rank before the checkpoint is published, adds more
    to it (e.g. the model in another format). Collective: every rank must call it. Returns the
    final checkpoint directory.
    """
    root = checkpoint_root(run_dir)
    final, tmp = _step_dir(root, step), root / f".tmp_step_{step:06d}"
    if _rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    payload = {name: module.state_dict() for name, module in modules.items()}
    payload["rng"] = _rng_state()
    torch.save(payload, tmp / f"rank_{_rank():05d}.pt")
    if write_extra is not None:
        write_extra(tmp)
    _barrier()
    if _rank() == 0:
        (tmp / "trainer_state.json").write_text(json.dumps(state.__dict__, indent=2))
        (tmp / COMPLETE_MARKER).write_text(str(_world_size()))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if keep_last > 0:
            for _, old in list_checkpoints(root)[:-keep_last]:
                shutil.rmtree(old)
    _barrier()
    return final


def load_checkpoint(
    path: Path, modules: dict[str, Any], *, optional: dict[str, Any] | None = None
) -> tuple[TrainerState, set[str]]:
    """Restore `modules` and this rank's RNG state from `path`, and each of `optional` that the
    checkpoint holds (a missing one is left as it is).

    Returns the trainer state and the names of the `optional` modules that were restored.
    """
    world = int((path / COMPLETE_MARKER).read_text())
    if world != _world_size():
        raise RuntimeError(f"{path} was saved by {world} ranks; resume it with the same number of processes, not {_world_size()}")
    payload = torch.load(path / f"rank_{_rank():05d}.pt", map_location="cpu", weights_only=False)
    for name, module in modules.items():
        if name not in payload:
            raise RuntimeError(f"{path}: checkpoint has no {name!r} state (has {sorted(payload)})")
        module.load_state_dict(payload[name])
    restored = {name for name in (optional or {}) if name in payload}
    for name in restored:
        optional[name].load_state_dict(payload[name])
    _set_rng_state(payload["rng"])
    return TrainerState(**json.loads((path / "trainer_state.json").read_text())), restored


def _rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
