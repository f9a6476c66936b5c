"""Parameter-space diagnostics of weight updates (spec opd.md §2-3) and subspace-constrained training.

Exports resolve on first use (PEP 562), so `megatron_armor.diagnostics.cli` builds its parser without
importing torch; `from megatron_armor.diagnostics import stable_rank` works as usual.
"""

import importlib

_EXPORTS = {
    "geometry": (
        "Factored", "PrincipalAngles", "basis_overlap", "factor", "hill_tail_index", "mask_overlap",
        "principal_angles", "spectral_drift", "stable_rank", "subspace_similarity", "top_right_vectors",
        "unchanged_fraction", "unchanged_mask", "update_scale",
    ),
    "report": ("MatrixMetrics", "diagnose", "diagnose_sources"),
    "settings": ("DiagnoseConfig", "LINEAR_LAYER_TYPES", "UNCHANGED_ETA"),
    "sources": ("LinearWeight", "MegatronSource", "Snapshot", "WeightSource", "checkpoint_snapshots", "linear_weights"),
    "subspace": ("SubspaceConstraint", "project_gradient", "record_subspace"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
