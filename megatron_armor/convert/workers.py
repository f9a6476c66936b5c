"""Conversion work done by several local processes: `armor convert ... --worker` under torchrun."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

from megatron_armor.distributed.launch import torchrun_command


class ConversionError(RuntimeError):
    """A conversion whose worker processes failed (their output says why)."""


def run_conversion_workers(nproc: int, cli_args: Sequence[str], *, failure: str) -> None:
    """Run `python -m megatron_armor.convert.cli <cli_args>` on `nproc` local ranks; `failure` is the
    message of the `ConversionError` raised when any of them fails."""
    if subprocess.call(torchrun_command(nproc, ["megatron_armor.convert.cli", *cli_args])) != 0:
        raise ConversionError(failure)
