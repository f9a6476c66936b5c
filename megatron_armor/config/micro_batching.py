"""`micro_batching`: how each rank cuts a mini-batch into forward/backward micro-batches (fixed sizes or token
budgets, padded or packed).

The section is what `scoring.micro_batches.MicroBatching` takes (with the padding multiple the tensor-parallel size
sets); no other class repeats its fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_armor.config.base import doc, require, require_at_least
from megatron_armor.config.builders import Buildable


@dataclass(frozen=True)
class MicroBatchingConfig(Buildable):
    """Micro-batches of the trainer's forwards and backwards: the old-logprob, reference, in-process teacher and
    update passes and the MIPU gate's."""

    component = "megatron_armor.scoring.micro_batches:MicroBatching"

    micro_batch_size: int = doc(8, "sequences per forward/backward (without a max_tokens budget)")
    max_tokens: int | None = doc(
        None, "token-budget micro-batches (verl's dynamic batch size): each rank bins its samples of a mini-batch into "
        "micro-batches of at most this many tokens (prompt + response; a longer sample gets a micro-batch of its own), "
        "each padded only to its own longest sample, or not at all with pack; unset: micro_batch_size sequences per "
        "micro-batch"
    )
    pack: bool = doc(
        False, "pack each micro-batch's sequences into one row with cu_seqlens (Megatron's PackedSeqParams, THD), so "
        "no padding token is computed; attention stays within each sequence"
    )

    def __post_init__(self) -> None:
        require_at_least("micro_batching", self, ("micro_batch_size",), 1)
        require(self.max_tokens is None or self.max_tokens >= 1,
                f"micro_batching.max_tokens must be >= 1 (or unset), got {self.max_tokens}")
