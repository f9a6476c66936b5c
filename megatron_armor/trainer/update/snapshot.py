"""`TrainingSnapshot`: a rank's trainable state before an update, for restoring it when the update is rejected
(the update gate) or skipped (a non-finite mini-batch after others were stepped)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from megatron_armor.diagnostics.subspace import SubspaceConstraint


@dataclass
class TrainingSnapshot:
    """theta_k and Omega_k of this rank: copies of the parameters the optimizer updates (`requires_grad`: under LoRA
    the adapters alone, not the frozen base), a deep copy of the Megatron optimizer state (Adam moments and step
    counts, fp32 master weights for bf16 models), the optimizer-step counter and the subspace constraint's state (its
    counters; W0 and the bases are never changed in place)."""

    params: list[torch.Tensor]
    optimizer_state: dict
    optimizer_steps: int
    constraint_state: dict | None = None

    @classmethod
    def capture(
        cls, ddp: torch.nn.Module, optimizer, optimizer_steps: int, constraint: SubspaceConstraint | None = None, *,
        to_host: bool = False,
    ) -> TrainingSnapshot:
        """Copy the state; `to_host` keeps the copies in CPU memory (a GPU shared with colocated servers)."""
        device = torch.device("cpu") if to_host else None
        return cls(
            params=[p.detach().to(device, copy=True) for p in _trained_parameters(ddp)],
            optimizer_state=_copy_tensors(optimizer.state_dict(), device),
            optimizer_steps=optimizer_steps,
            constraint_state=None if constraint is None else constraint.state_dict(),
        )

    @torch.no_grad()
    def restore(self, ddp: torch.nn.Module, optimizer, constraint: SubspaceConstraint | None = None) -> None:
        """Put the weights, optimizer state and constraint state back bit for bit (the snapshot stays reusable)."""
        for param, saved in zip(_trained_parameters(ddp), self.params, strict=True):
            param.copy_(saved)
        optimizer.load_state_dict(copy.deepcopy(self.optimizer_state))
        if constraint is not None:
            constraint.load_state_dict(self.constraint_state)


def _trained_parameters(ddp: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of the DDP-wrapped model that the optimizer updates, in module order: those with
    `requires_grad` (a frozen parameter, e.g. a LoRA run's base, is never changed by an update)."""
    return [param for param in ddp.module.parameters() if param.requires_grad]


def _copy_tensors(tree, device: torch.device | None):
    """A deep copy of a state-dict tree whose tensors are copied to `device` (None: where they are)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to(device, copy=True)
    if isinstance(tree, dict):
        return {key: _copy_tensors(value, device) for key, value in tree.items()}
    if type(tree) in (list, tuple):
        return type(tree)(_copy_tensors(value, device) for value in tree)
    return copy.deepcopy(tree)
