"""Megatron's multi-latent attention (`MLASelfAttention`, DeepSeek-V3) on the local layer spec, with the gradient of
its shared rotary key summed over the tensor-parallel ranks.

On the local spec the key/value down projection is a `ColumnParallelLinear`: each TP rank computes its share of the
[kv_lora_rank + qk_rope_head_dim] outputs and Megatron all-gathers them (megatron-core 0.19,
`MultiLatentAttention.get_query_key_value_tensors`). The rotary key (the last qk_rope_head_dim outputs) is shared by
every head, but each rank applies it to its own heads only, so its gradient on a rank is that rank's heads' share;
the all-gather's backward keeps the rank's slice of it unsummed, and the down projection's weight gradient misses
the other ranks' heads (Transformer Engine's spec keeps the projection whole and sums the rotary key's gradient
with its sequence-parallel all-gather). `LocalMLASelfAttention` hands Megatron the down projection's output already
gathered, the rotary key's columns behind a TP all-reduce in the backward (`copy_to_tensor_model_parallel_region`)
or, under sequence parallelism, split over the sequence again, where Megatron's own all-gather of the rotary key over
the sequence sums its gradient (`gather_from_sequence_parallel_region`'s reduce-scatter); everything else is
Megatron's. TP 1 is Megatron's path unchanged.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region, gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.utils import get_pg_size


class LocalMLASelfAttention(MLASelfAttention):
    """`MLASelfAttention` whose column-parallel key/value down projection's rotary key gets its whole gradient."""

    def _qkv_down_projection(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(query latent, key/value latent with the rotary key): Megatron's, the latter [s, b, kv_lora_rank +
        qk_rope_head_dim] gathered over TP (or [s/tp, ...] split over the sequence under sequence parallelism), which
        Megatron then splits as the output of a whole projection."""
        q_compressed, kv_combined = super()._qkv_down_projection(hidden_states)
        if get_pg_size(self.tp_group) == 1:
            return q_compressed, kv_combined
        kv_combined = gather_from_tensor_model_parallel_region(kv_combined, group=self.tp_group)
        if self.config.sequence_parallel:
            return q_compressed, scatter_to_sequence_parallel_region(kv_combined, group=self.tp_group)
        latent, rotary_key = kv_combined.split([self.config.kv_lora_rank, self.config.qk_pos_emb_head_dim], dim=-1)
        rotary_key = copy_to_tensor_model_parallel_region(rotary_key, group=self.tp_group)
        return q_compressed, torch.cat([latent, rotary_key], dim=-1)
