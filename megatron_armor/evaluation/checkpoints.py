"""Which checkpoints `armor eval` evaluates, from what a user names on the command line:

- an HF checkpoint directory (config.json and *.safetensors);
- a Megatron checkpoint (`armor convert hf-to-megatron`'s, or a run's `checkpoints/step_N/model`);
- a run's checkpoint `checkpoints/step_N` (its `model/`, written with checkpoint.save_model);
- a glob of those (`run/checkpoints/step_*`), in step order;
- a run's `checkpoints/BEST` note (checkpoint.keep_best): the checkpoint it names.

Every name resolves, or fails with a clear error, before any model loads.
"""

from __future__ import annotations

import glob
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_armor.convert.megatron_checkpoint import is_megatron_checkpoint

MODEL_DIR = "model"  # a run checkpoint's Megatron model (trainer's checkpoint.save_model)
_STEP = re.compile(r"^step_(\d+)$")


class CheckpointSpecError(ValueError):
    """A named checkpoint that does not exist or is not one `armor eval` can load."""


@dataclass(frozen=True)
class EvalCheckpoint:
    """A model to evaluate: `path` (an HF directory or a Megatron checkpoint), `label` for file names and tables,
    `step` of the run that saved it (None outside a run)."""

    label: str
    path: Path
    step: int | None
    megatron: bool


def resolve_checkpoints(specs: Sequence[str]) -> list[EvalCheckpoint]:
    """The checkpoints `specs` name, in the order given (a glob's matches by step, then name); labels are unique."""
    resolved = [checkpoint for spec in specs for checkpoint in _resolve(spec)]
    labels = [c.label for c in resolved]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise CheckpointSpecError(f"checkpoints named twice (or two with the same label): {duplicates}")
    return resolved


def _resolve(spec: str) -> list[EvalCheckpoint]:
    if glob.has_magic(spec):
        matches = sorted(glob.glob(spec), key=lambda p: (_step_of(Path(p)) or -1, p))
        if not matches:
            raise CheckpointSpecError(f"{spec}: no checkpoint matches")
        return [_checkpoint(Path(match), spec) for match in matches]
    path = Path(spec)
    if path.name == "BEST" and path.is_file():
        try:
            note = json.loads(path.read_text())
            return [_checkpoint(path.parent / note["path"], spec)]
        except (ValueError, KeyError) as error:
            raise CheckpointSpecError(f"{spec}: not a checkpoints/BEST note ({error})") from error
    return [_checkpoint(path, spec)]


def _checkpoint(path: Path, spec: str) -> EvalCheckpoint:
    if not path.exists():
        raise CheckpointSpecError(f"{spec}: {path} does not exist")
    step = _step_of(path)
    if _STEP.match(path.name):  # a run's checkpoint: its model
        if not is_megatron_checkpoint(path / MODEL_DIR):
            raise CheckpointSpecError(f"{path}: a run checkpoint without {MODEL_DIR}/ (saved with "
                                      f"checkpoint.save_model false): nothing to evaluate")
        return EvalCheckpoint(path.name, path / MODEL_DIR, step, megatron=True)
    label = f"step_{step:06d}" if step is not None else path.name
    if is_megatron_checkpoint(path):
        return EvalCheckpoint(label, path, step, megatron=True)
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return EvalCheckpoint(label, path, step, megatron=False)
    raise CheckpointSpecError(f"{spec}: {path} is neither an HF checkpoint (config.json, *.safetensors), a Megatron "
                              f"checkpoint nor a run's checkpoints/step_N")


def _step_of(path: Path) -> int | None:
    """N of the nearest `step_N` among `path` and its parent (a run's step_N or step_N/model)."""
    for part in (path.name, path.parent.name):
        match = _STEP.match(part)
        if match:
            return int(match.group(1))
    return None
