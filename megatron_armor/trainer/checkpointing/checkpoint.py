"""Resumable training checkpoints: the trainer's full state as one Megatron distributed checkpoint.

A trainer state is `RLTrainer.sharded_state_dict()`: its "modules" entry maps names to Megatron sharded state
dicts (actor, optimizer with the distributed optimizer's shards, the reference once trained, ...; see
trainer/checkpointing/sharded_state.py) and its other entries are JSON-able and the same on every rank.
Layout under `<run_dir>/checkpoints/`:
    step_000010/state/              Megatron `dist_checkpointing` (torch_dist backend): every rank writes only
                                    its own shards (*.distcp) of the modules and its RNG states; `.metadata`
                                    maps every tensor's global key to them
    step_000010/trainer_state.json  {"format_version": 2, "step", "layout": {"tp", "pp", "dp"} it was saved at,
                                    "modules": their names, "sampler": data position, "extra": every other entry}
    step_000010/model/              (optional) the actor as a Megatron distributed checkpoint that
                                    `armor convert megatron-to-hf` and `armor diagnose` read
    step_000010/COMPLETE            written last; a directory without it is never loaded
A checkpoint is written into `.tmp_step_000010/` and renamed into place, with its COMPLETE marker, only once
every rank has written its shards (trainer/checkpointing/checkpoint_save.py, also for the asynchronous save), so a crash
or a SIGKILL mid-save never leaves a directory that looks complete and the previous checkpoint stays the latest.

A checkpoint resumes at any TP x PP x DP layout (and with or without the distributed optimizer): tensors are
stored under global keys and each rank reads the slices its layout needs. RNG states are per rank: at the saved
layout each rank gets its own back; at another every rank is reseeded from (train.seed, step, rank)
(trainer/checkpointing/rng_state.py). Checkpoints of the per-rank `rank_XXXXX.pt` format (format 1, before distributed
checkpointing) and unreadable ones are refused with `CheckpointFormatError`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_armor.trainer.checkpointing.best_checkpoint import BestCheckpoint
from megatron_armor.trainer.checkpointing.dist_state_io import load_tree, saved_tensor_keys
from megatron_armor.trainer.checkpointing.rng_state import (
    layout, reseed_after_layout_change, restore_rng_state, rng_sharded_object,
)
from megatron_armor.trainer.checkpointing.sharded_state import check_layout_change, check_precision_change

COMPLETE_MARKER = "COMPLETE"
STATE_DIR = "state"
RECORD_FILE = "trainer_state.json"
FORMAT_VERSION = 2
TOP_LEVEL_ENTRIES = ("sampler",)  # trainer_state.json holds these beside "step", the other entries under "extra"


class CheckpointExistsError(RuntimeError):
    """A run directory already holds checkpoints and neither resume nor overwrite was requested."""


class CheckpointFormatError(RuntimeError):
    """A checkpoint this version cannot read: an older format, or a damaged trainer_state.json."""


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dirs(root: Path, step: int) -> tuple[Path, Path]:
    """(final, temporary) directory of the checkpoint of step `step` under `root`."""
    return root / f"step_{step:06d}", root / f".tmp_step_{step:06d}"


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
    if overwrite and root.exists() and process_rank() == 0:
        shutil.rmtree(root)
    barrier()
    return None


def shared_record(step: int, state: dict[str, Any]) -> dict[str, Any]:
    """trainer_state.json of a trainer `state` saved after `step` steps at this run's layout."""
    top = {key: state[key] for key in TOP_LEVEL_ENTRIES if key in state}
    extra = {key: value for key, value in state.items() if key not in ("modules", *TOP_LEVEL_ENTRIES)}
    return {"format_version": FORMAT_VERSION, "step": step, "layout": layout(), "modules": list(state["modules"]),
            **top, "extra": extra}


def publish(tmp: Path, final: Path, record: dict[str, Any], *, keep_last: int, best: BestCheckpoint | None = None) -> None:
    """Every rank has written into `tmp` (collective): rank 0 writes trainer_state.json and the COMPLETE
    marker, renames `tmp` to `final`, names it in checkpoints/BEST when it is the `best`, and prunes all but the
    newest `keep_last` checkpoints (0: keep all) and the best."""
    barrier()
    if process_rank() == 0:
        (tmp / RECORD_FILE).write_text(json.dumps(record, indent=2))
        (tmp / COMPLETE_MARKER).write_text(str(_world_size()))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if best is not None and best.step == record["step"]:
            best.write_note(final.parent, final.name)
        if keep_last > 0:
            for step, old in list_checkpoints(final.parent)[:-keep_last]:
                if best is None or step != best.step:
                    shutil.rmtree(old)
    barrier()


def read_record(path: Path) -> dict[str, Any]:
    """The checkpoint's trainer_state.json; `CheckpointFormatError` for another format or a damaged file."""
    if (path / "rank_00000.pt").is_file():
        raise CheckpointFormatError(
            f"{path} is a per-rank checkpoint (rank_XXXXX.pt, format 1) of an older megatron-armor; this version "
            f"reads Megatron distributed checkpoints (format {FORMAT_VERSION}): resume it with the version that "
            f"wrote it, or start a new run")
    try:
        record = json.loads((path / RECORD_FILE).read_text())
    except (OSError, ValueError) as error:
        raise CheckpointFormatError(f"{path}: unreadable {RECORD_FILE} ({error})") from error
    if record.get("format_version") != FORMAT_VERSION or not (path / STATE_DIR).is_dir():
        raise CheckpointFormatError(f"{path}: checkpoint format {record.get('format_version')} (state dir "
                                    f"present: {(path / STATE_DIR).is_dir()}); this version reads format {FORMAT_VERSION}")
    return record


def saved_modules(path: Path) -> list[str]:
    """The names of the modules the checkpoint at `path` holds (what a load request must cover)."""
    return read_record(path)["modules"]


def load_checkpoint(path: Path, request: dict[str, Any], *, seed: int) -> tuple[int, dict[str, Any]]:
    """The step and the trainer state saved at `path` (collective). `request`: the loading trainer's
    `sharded_state_dict(is_loading=True)` for `saved_modules(path)`; the state's "modules" are its
    entries with the saved (resharded) values. Restores this rank's RNG states at the saved layout,
    reseeds them from `seed` at another."""
    record = read_record(path)
    same_layout = record["layout"] == layout()
    if not same_layout:
        check_layout_change(record["modules"], record["layout"], layout())
    check_precision_change(saved_tensor_keys(path / STATE_DIR), request["modules"])
    tree = {"modules": request["modules"], **({"rng": rng_sharded_object()} if same_layout else {})}
    loaded = load_tree(tree, path / STATE_DIR)
    if same_layout:
        restore_rng_state(loaded["rng"])
    else:
        reseed_after_layout_change(seed, record["step"], record["layout"])
    top = {key: record[key] for key in TOP_LEVEL_ENTRIES if key in record}
    return record["step"], {**top, **record["extra"], "modules": loaded["modules"]}


def load_modules(path: Path, request: dict[str, Any]) -> dict[str, Any]:
    """Some of the modules saved at `path`, at this run's layout (collective), and nothing else: no RNG state, no
    data position. `request`: the loading trainer's `sharded_state_dict(is_loading=True, names=...)["modules"]` for
    modules the checkpoint holds (e.g. the actor alone); returns them loaded, for `restore_module`."""
    record = read_record(path)
    if record["layout"] != layout():
        check_layout_change(list(request), record["layout"], layout())
    return load_tree({"modules": request}, path / STATE_DIR)["modules"]


def process_rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    """A barrier over all ranks (nothing without a process group)."""
    if dist.is_initialized():
        dist.barrier()
