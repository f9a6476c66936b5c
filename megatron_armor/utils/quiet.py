"""Silence third-party start-up noise that says nothing actionable on this stack.

Each entry names why it is harmless here; everything else (and every error) still prints.
"""

from __future__ import annotations

import logging
import os
import warnings

_HARMLESS_WARNINGS = (
    # Megatron falls back to torch norms/optimizers without apex / Transformer Engine (CPU runs; GPU
    # users see `megatron_armor` report which fused paths it found).
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"MimoModelConfig is experimental",  # imported by Megatron's package init; not used here
    r"full scope is deprecated",  # a CUDA-graph default inside TransformerConfig; CUDA graphs are off
    r"CUDA_DEVICE_MAX_CONNECTIONS",  # async TP all-reduce advice; irrelevant without CUDA streams
)
_QUIET_LOGGERS = {
    "torch.utils.cpp_extension": logging.ERROR,  # "No CUDA runtime is found" on CPU machines
    "megatron.core.models.gpt.gpt_model": logging.ERROR,  # GPTModel deprecation; models/gpt.py says why we use it
    "megatron.core.distributed": logging.WARNING,  # per-parameter bucket listings
    "megatron.core.optimizer": logging.WARNING,  # the full OptimizerConfig dump
    "megatron.core.rerun_state_machine": logging.ERROR,  # "implicit initialization" notices
    "megatron.core.dist_checkpointing.strategies.torch": logging.ERROR,  # async-save deprecation; we save synchronously
}


def quiet_third_party_noise() -> None:
    """Install the filters in this process (call before Megatron/transformers are imported)."""
    for pattern in _HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=f".*{pattern}")
    for name, level in _QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # "Loading weights" bars of tiny checkpoints
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
