"""What `armor diagnose` analyzes and with which constants (torch-free, so the CLI parser stays light)."""

from __future__ import annotations

from dataclasses import dataclass, field

UNCHANGED_ETA = 1e-3  # relative tolerance of the bf16-aware unchanged rule (spec opd.md §2.1)
LINEAR_LAYER_TYPES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class DiagnoseConfig:
    """Knobs of the diagnostics; defaults are the spec's (k_hill is open there)."""

    k_angles: int = field(default=512, metadata={"help": "top-k singular subspaces compared by principal angles "
                                                          "(clamped to min(out, in))"})
    k_sim: int = field(default=16, metadata={"help": "K of the subspace similarity Sim_K(t, t_end)"})
    k_hill: int = field(default=16, metadata={"help": "top singular values of dW used by the Hill tail index"})
    mask_rank: int = field(default=64, metadata={"help": "rank of the W0 reconstruction for the principal mask"})
    mask_alpha: float = field(default=0.5, metadata={"help": "fraction of entries in the principal / low-magnitude "
                                                              "masks (the random-overlap baseline)"})
    eta: float = field(default=UNCHANGED_ETA, metadata={"help": "relative tolerance of the bf16-aware unchanged rule"})
    layer_types: tuple[str, ...] = field(default=LINEAR_LAYER_TYPES,
                                         metadata={"help": "linear weight types to analyze"})

    def __post_init__(self) -> None:
        for name, low in (("k_angles", 1), ("k_sim", 1), ("k_hill", 2), ("mask_rank", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"DiagnoseConfig.{name} must be >= {low}, got {getattr(self, name)}")
        if not 0.0 < self.mask_alpha < 1.0:
            raise ValueError(f"DiagnoseConfig.mask_alpha must lie in (0, 1), got {self.mask_alpha}")
        unknown = set(self.layer_types) - set(LINEAR_LAYER_TYPES)
        if unknown:
            raise ValueError(
                f"DiagnoseConfig.layer_types: unknown {sorted(unknown)}; choose from {LINEAR_LAYER_TYPES}"
            )
