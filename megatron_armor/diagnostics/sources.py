"""Where diagnosed weights come from: named 2-D tensors of a checkpoint, and which of them are analyzed.

Any object with `names()` and `get(name)` under HF tensor names is a `WeightSource`; HF safetensors
directories are read with `HFCheckpointReader`. A Megatron checkpoint (any TP/PP) plugs in as a source
that gathers shards and maps them to HF names (q/k/v split out of a fused QKV).
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from megatron_armor.diagnostics.settings import LINEAR_LAYER_TYPES

# model.layers.<i>.self_attn.q_proj.weight, model.layers.<i>.mlp.down_proj.weight, ...
_LINEAR_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.weight$")
_TRAILING_INT = re.compile(r"(\d+)\D*$")


class WeightSource(Protocol):
    """Named tensors of one checkpoint under HF names."""

    def names(self) -> set[str]: ...

    def get(self, name: str) -> torch.Tensor: ...


@dataclass(frozen=True)
class Snapshot:
    """One checkpoint of a trajectory: a label for reports, its training step, and its weights."""

    label: str
    step: int
    source: WeightSource


@dataclass(frozen=True)
class LinearWeight:
    """A 2-D linear weight chosen for diagnosis: its HF name, decoder layer index and type (e.g. "q_proj")."""

    name: str
    layer: int
    layer_type: str


def linear_weights(names: Iterable[str], layer_types: Sequence[str] = LINEAR_LAYER_TYPES) -> list[LinearWeight]:
    """The decoder linear weights among `names` whose type is in `layer_types`, by layer then type order.

    Embeddings, lm_head, norms and biases are not selected (not per-layer linear maps).
    """
    chosen = []
    for name in names:
        match = _LINEAR_NAME.search(name)
        if match and match.group(2) in layer_types:
            chosen.append(LinearWeight(name, int(match.group(1)), match.group(2)))
    return sorted(chosen, key=lambda w: (w.layer, layer_types.index(w.layer_type)))


def hf_snapshots(model_dirs: Sequence[str | Path]) -> list[Snapshot]:
    """HF checkpoint directories as snapshots, steps parsed from the last number in each directory name

    (`step_000063` -> 63, `checkpoint-300` -> 300). If a name has no number or two share one, the steps
    are the positions 1..N in the given order instead.
    """
    from megatron_armor.convert.weights import HFCheckpointReader  # imports Megatron-Core; only when reading

    paths = [Path(d) for d in model_dirs]
    numbers = [_TRAILING_INT.search(p.name) for p in paths]
    steps = [int(m.group(1)) for m in numbers if m]
    if len(steps) != len(paths) or len(set(steps)) != len(steps):
        steps = list(range(1, len(paths) + 1))
    return [Snapshot(p.name, step, HFCheckpointReader(p)) for p, step in zip(paths, steps)]


def as_hf_checkpoint(path: str | Path, scratch: Path) -> Path:
    """`path` itself for an HF directory; a Megatron checkpoint (`armor convert` output, or a training
    checkpoint's `step_N/model/`, saved at any TP/PP) exported to HF under `scratch` first, in a folder
    named after it (`step_N/model` -> `step_N`) so its step can still be read from the name."""
    from megatron_armor.convert.hf_export import convert_megatron_to_hf  # imports Megatron-Core
    from megatron_armor.convert.megatron_checkpoint import is_megatron_checkpoint

    path = Path(path)
    if not is_megatron_checkpoint(path):
        return path
    name = path.parent.name if path.name == "model" else path.name
    scratch.mkdir(parents=True, exist_ok=True)
    return convert_megatron_to_hf(path, Path(tempfile.mkdtemp(dir=scratch)) / name)
