"""Fused Triton LM-head kernels: logprobs, entropy and the ARMOR loss without materialising [N, V] logits.

On CPU the kernels run only under the Triton interpreter (TRITON_INTERPRET=1 set before this package is
imported); `reference` holds the plain-torch implementations.
"""

from megatron_armor.kernels.fused import fused_armor_loss, fused_logprobs

__all__ = ["fused_armor_loss", "fused_logprobs"]
