"""Resumable training checkpoints of a trainer's `state_dict()`: per-rank shards plus shared trainer state.

A trainer state is a dict whose "modules" entry maps names to this rank's state dicts (model shard,
optimizer state, ...) and whose other entries are JSON-able and the same on every rank (`RLTrainer.state_dict`).
Layout under `<run_dir>/checkpoints/`:
    step_000010/rank_00000.pt ...   one file per rank: {name: state dict of "modules"..., "rng": RNG states}
    step_000010/trainer_state.json  {"step", "sampler": data position, "extra": every other entry}
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

COMPLETE_MARKER = "COMPLETE"


class CheckpointExistsError(RuntimeError):
    """A run directory already holds checkpoints and neither resume nor overwrite was requested."""


TOP_LEVEL_ENTRIES = ("sampler",)  # trainer_state.json holds these beside "step", the other entries under "extra"


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
    run_dir: str | Path, step: int, state: dict[str, Any], *, keep_last: int = 0,
    write_extra: Callable[[Path], None] | None = None,
) -> Path:
    """Save a trainer `state` (a `state_dict()`, see the module docstring) of every rank as step `step`.

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
    torch.save({**state["modules"], "rng": _rng_state()}, tmp / f"rank_{_rank():05d}.pt")
    if write_extra is not None:
        write_extra(tmp)
    _barrier()
    if _rank() == 0:
        (tmp / "trainer_state.json").write_text(json.dumps(_shared_record(step, state), indent=2))
        (tmp / COMPLETE_MARKER).write_text(str(_world_size()))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if keep_last > 0:
            for _, old in list_checkpoints(root)[:-keep_last]:
                shutil.rmtree(old)
    _barrier()
    return final


def load_checkpoint(path: Path) -> tuple[int, dict[str, Any]]:
    """The step and the trainer state saved at `path` ("modules": this rank's shards, on the CPU); restores
    this rank's RNG states."""
    world = int((path / COMPLETE_MARKER).read_text())
    if world != _world_size():
        raise RuntimeError(f"{path} was saved by {world} ranks; resume it with the same number of processes, not {_world_size()}")
    modules = torch.load(path / f"rank_{_rank():05d}.pt", map_location="cpu", weights_only=False)
    _set_rng_state(modules.pop("rng"))
    record = json.loads((path / "trainer_state.json").read_text())
    state = {**{key: record[key] for key in TOP_LEVEL_ENTRIES if key in record}, **record["extra"], "modules": modules}
    return record["step"], state


def _shared_record(step: int, state: dict[str, Any]) -> dict[str, Any]:
    """trainer_state.json: the step, `TOP_LEVEL_ENTRIES` and, under "extra", every other entry but "modules"."""
    top = {key: state[key] for key in TOP_LEVEL_ENTRIES if key in state}
    extra = {key: value for key, value in state.items() if key not in ("modules", *TOP_LEVEL_ENTRIES)}
    return {"step": step, **top, "extra": extra}


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
