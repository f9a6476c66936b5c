"""Core attention for the local (non-Transformer-Engine) layer spec, on torch SDPA.

Megatron's local `DotProductAttention` allocates its score matrix from a CUDA-only global memory
buffer, so it cannot run on CPU. This module takes the same constructor and forward arguments and
computes causal (GQA-aware) attention with `torch.nn.functional.scaled_dot_product_attention`,
which dispatches to flash/memory-efficient kernels on GPU and a fused C++ kernel on CPU.

Packed sequences (Megatron's `PackedSeqParams`, THD format: the sequences of a micro-batch concatenated
along one token dimension, `cu_seqlens` their offsets) are attended one sequence at a time, each causal, so
no token sees another sequence's.

Under context parallelism (`config.context_parallel_size` > 1) each rank holds its zig-zag chunks of every
sequence (`distributed.context_parallel`): the keys and values are all-gathered over the CP group (the simplest
exact scheme: the gradient of the gathered keys and values is summed back over the group), and each local query
attends to the keys at global positions up to its own; packed sequences (THD) are split sequence by sequence, each
rank's chunks of a sequence attending over that sequence's gathered keys and values.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_armor.distributed.context_parallel import ZigZag, gather_sequence


class SDPAttention(MegatronModule):
    """Drop-in `core_attention` submodule of `SelfAttention` (tensor-parallel heads; context parallel by an
    all-gather of keys and values)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ) -> None:
        super().__init__(config=config)
        # k_channels / v_channels: multi-latent attention's query/key and value dims per head (they differ), which
        # the tensors it is given carry
        del layer_number, attention_type, cp_comm_type, k_channels, v_channels
        self.cp_group = None
        if config.context_parallel_size > 1:
            cp_group = getattr(pg_collection, "cp", None)
            self.cp_group = cp_group if cp_group is not None else parallel_state.get_context_parallel_group()
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """query/key: [sq, b, heads, d] / [sk, b, groups, d]; value: [sk, b, groups, dv] (dv = d but in multi-latent
        attention); attention_mask: optional bool [b or 1, 1, sq, sk], True = masked out (Megatron convention).
        Returns [sq, b, heads * dv]. Packed (THD `packed_seq_params`): query [t, heads, d], key/value [t, groups, d]
        -> [t, heads, dv] (the attention module flattens the heads, after multi-latent attention trims the value
        dims it padded)."""
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention does not support attention bias")
        mask_type = attn_mask_type or self.attn_mask_type
        if self.cp_group is not None:
            return self._attend_context_parallel(query, key, value, attention_mask, packed_seq_params, mask_type)
        if packed_seq_params is not None:
            return self._attend_packed(query, key, value, packed_seq_params, mask_type)
        causal = attention_mask is None and mask_type == AttnMaskType.causal
        return self._attend(query, key, value, attention_mask, causal)

    def _attend_packed(self, query, key, value, packed_seq_params, mask_type: AttnMaskType) -> torch.Tensor:
        """Causal attention within each sequence of a THD pack; [t, heads, d] in, [t, heads, dv] out."""
        if packed_seq_params.qkv_format != "thd" or mask_type != AttnMaskType.causal:
            raise NotImplementedError(f"SDPAttention packs only causal THD sequences, got "
                                      f"{packed_seq_params.qkv_format} {mask_type}")
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        pieces = [self._attend(query[a:b, None], key[a:b, None], value[a:b, None], None, causal=True)
                  for a, b in zip(bounds[:-1], bounds[1:])]
        return torch.cat(pieces).reshape(query.shape[0], query.shape[1], value.shape[-1])

    def _attend_context_parallel(self, query, key, value, attention_mask, packed_seq_params,
                                 mask_type: AttnMaskType) -> torch.Tensor:
        """Causal attention of this CP rank's zig-zag chunks: query [2c, b, heads, d] over the whole sequence's
        keys/values (all-gathered from the local [2c, b, groups, d]) -> [2c, b, heads * dv]. Packed (THD,
        `packed_seq_params.cu_seqlens_q` the global offsets): query [t, heads, d], key/value [t, groups, d], this
        rank's chunks of every sequence, each attending over its own sequence -> [t, heads, dv]."""
        if attention_mask is not None or mask_type != AttnMaskType.causal:
            raise NotImplementedError("SDPAttention under context parallelism attends causally only (no explicit "
                                      "attention mask)")
        layout = ZigZag.current(self.cp_group)
        if packed_seq_params is None:
            key = gather_sequence(key, 0, reduce_grad=True, group=self.cp_group)
            value = gather_sequence(value, 0, reduce_grad=True, group=self.cp_group)
            masked = layout.causal_mask(key.shape[0], device=query.device)  # [2c, S]
            return self._attend(query, key, value, masked[None, None], causal=False)
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        key, value = (gather_sequence(t, 0, reduce_grad=True, group=self.cp_group, cu_seqlens=bounds)
                      for t in (key, value))  # [T, groups, d], the packed row in global order
        pieces = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            local = slice(start // layout.size, end // layout.size)  # this rank's chunks of the sequence
            masked = layout.causal_mask(end - start, device=query.device)
            pieces.append(self._attend(query[local, None], key[start:end, None], value[start:end, None],
                                       masked[None, None], causal=False))
        return torch.cat(pieces).reshape(query.shape[0], query.shape[1], value.shape[-1])

    def _attend(self, query, key, value, attention_mask, causal: bool) -> torch.Tensor:
        """SDPA of query [sq, b, heads, d] over key [sk, b, groups, d] and value [sk, b, groups, dv]
        -> [sq, b, heads * dv]."""
        seq_q, batch, heads, _ = query.shape
        groups = key.shape[2]
        # [s, b, h, d] -> [b, h, s, d]; repeat K/V so each query head sees its group's K/V.
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3).repeat_interleave(heads // groups, dim=1)
        v = value.permute(1, 2, 0, 3).repeat_interleave(heads // groups, dim=1)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=None if attention_mask is None else ~attention_mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=causal,
            scale=self.softmax_scale,
        )
        return out.permute(2, 0, 1, 3).reshape(seq_q, batch, heads * value.shape[-1])
