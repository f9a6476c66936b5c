"""All-or-nothing output directories: write into a staging directory, publish it by renaming.

A conversion writes `<parent>/.<name>.partial/` and renames it to `<parent>/<name>` only once
complete, so a failure at any point leaves no directory that looks like a checkpoint (`staged_output`
removes the staging directory on failure; a stale one is cleared by the next run).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path


class OutputExistsError(RuntimeError):
    """The output directory is already in use and the caller did not allow replacing it."""


def staging_dir(out: str | Path) -> Path:
    out = Path(out).resolve()
    return out.parent / f".{out.name}.partial"


def check_output_dir(out: str | Path, *, overwrite: bool, is_checkpoint: Callable[[Path], bool], kind: str) -> None:
    """Refuse an output directory that holds anything, unless it is a `kind` checkpoint and `overwrite`.

    A non-empty directory that is not such a checkpoint is never replaced, even with `overwrite`.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"--out {out} is a file; give a directory path")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not is_checkpoint(out):
        raise OutputExistsError(f"--out {out} is not empty and is not a {kind} checkpoint; choose a new or empty directory")
    if not overwrite:
        raise OutputExistsError(f"--out {out} already holds a {kind} checkpoint; pass --overwrite to replace it")


def fresh_staging_dir(out: str | Path) -> Path:
    """An empty staging directory for `out` (a stale one from an interrupted run is removed)."""
    staging = staging_dir(out)
    discard(staging)
    staging.mkdir(parents=True)
    return staging


def publish(staging: Path, out: str | Path) -> None:
    """Move the complete `staging` directory to `out`, replacing what `check_output_dir` allowed."""
    out = Path(out).resolve()
    previous = out.parent / f".{out.name}.previous"
    discard(previous)
    if out.exists():
        os.replace(out, previous)
    os.replace(staging, out)
    discard(previous)


@contextlib.contextmanager
def staged_output(out: str | Path) -> Iterator[Path]:
    """A fresh staging directory for `out`, published as `out` when the block completes and removed
    whatever happens."""
    staging = fresh_staging_dir(out)
    try:
        yield staging
        publish(staging, out)
    finally:
        discard(staging)


def discard(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
