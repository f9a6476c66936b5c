"""Conversion work done by several local processes: `armor convert ... --worker` under torchrun."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence

from megatron_armor.distributed.launch import torchrun_command


class ConversionError(RuntimeError):
    """A conversion whose worker processes failed (their output says why)."""


def run_conversion_workers(nproc: int, cli_args: Sequence[str], *, failure: str) -> None:
    """Run `python -m megatron_armor.convert.cli <cli_args>` on `nproc` local ranks; `failure` is the
    message of the `ConversionError` raised when any of them fails.

    The workers see no GPU: conversion is CPU work (gloo, meta-device models, file reads), and on a GPU
    host they would otherwise each claim GPU `LOCAL_RANK` (failing past the GPU count, or taking GPUs
    that training uses).
    """
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    if subprocess.call(torchrun_command(nproc, ["megatron_armor.convert.cli", *cli_args]), env=env) != 0:
        raise ConversionError(failure)
