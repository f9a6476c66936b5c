"""Where diagnosed weights come from: named 2-D tensors of a checkpoint, and which of them are analyzed.

Any object with `names()` and `get(name)` under HF tensor names is a `WeightSource`; HF safetensors
directories are read with `HFCheckpointReader`, Megatron checkpoints (any TP/PP) in place with
`MegatronSource`, which reads each requested matrix from the distributed checkpoint (q/k/v split out
of the fused QKV, gate/up out of fc1): nothing is exported to disk.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from megatron_armor.diagnostics.settings import LINEAR_LAYER_TYPES

if TYPE_CHECKING:
    from megatron_armor.convert.mapping import ParamMapping

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


def checkpoint_snapshots(paths: Sequence[str | Path]) -> list[Snapshot]:
    """Checkpoint directories, HF or Megatron (`armor convert` output, or a training checkpoint's
    `step_N/model/`), as snapshots labelled by directory name (`step_N/model` -> `step_N`).

    Steps are parsed from the last number in each label (`step_000063` -> 63, `checkpoint-300` -> 300).
    If a label has no number or two share one, the steps are the positions 1..N in the given order instead.
    """
    paths = [Path(p) for p in paths]
    labels = [p.parent.name if p.name == "model" else p.name for p in paths]
    numbers = [_TRAILING_INT.search(label) for label in labels]
    steps = [int(m.group(1)) for m in numbers if m]
    if len(steps) != len(paths) or len(set(steps)) != len(steps):
        steps = list(range(1, len(paths) + 1))
    return [Snapshot(label, step, _open(path)) for path, label, step in zip(paths, labels, steps)]


def _open(path: Path) -> WeightSource:
    from megatron_armor.convert.megatron_checkpoint import is_megatron_checkpoint  # imports Megatron-Core
    from megatron_armor.convert.weights import HFCheckpointReader

    return MegatronSource(path) if is_megatron_checkpoint(path) else HFCheckpointReader(path)


class MegatronSource:
    """A Megatron checkpoint (saved at any TP/PP) as a `WeightSource`: each HF tensor is read from the
    checkpoint when asked, as the full matrix in the checkpoint's dtype.

    Keeps the HF tensors of the last Megatron parameter read, so q, k and v (or gate and up) asked in
    a row cost one read of the fused parameter; memory is that one parameter.
    """

    def __init__(self, path: str | Path) -> None:
        from megatron_armor.convert.hf_export import read_megatron_checkpoint  # imports Megatron-Core

        self._stage = read_megatron_checkpoint(path)
        self._mapping_of = {name: m for m in self._stage.mappings for name in m.hf_names}
        self._last: tuple[ParamMapping | None, list[torch.Tensor]] = (None, [])  # a parameter, its HF tensors

    def names(self) -> set[str]:
        return set(self._mapping_of)

    def get(self, name: str) -> torch.Tensor:
        mapping = self._mapping_of[name]
        if self._last[0] != mapping:
            self._last = (mapping, self._stage.read(mapping))
        return self._last[1][mapping.hf_names.index(name)]
