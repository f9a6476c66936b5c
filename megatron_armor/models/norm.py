"""RMSNorm for the local (non-Transformer-Engine) layer spec under sequence parallelism.

Megatron's `WrappedTorchNorm` refuses `sequence_parallel` configs: under sequence parallelism each tensor-parallel
rank normalises its own slice of the sequence, so a norm weight's gradient is partial and must be summed over
the TP group, which Megatron's `finalize_model_grads` does for parameters marked `sequence_parallel`. This norm is
torch's `RMSNorm` (the module `WrappedTorchNorm` builds, same parameters and state-dict keys) with that mark.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm over the last dimension whose weight is marked `sequence_parallel` (grads summed over TP)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel
