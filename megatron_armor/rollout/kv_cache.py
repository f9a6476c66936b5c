"""A KV cache for `LocalEngine` that is allocated once per batch and shrinks with it.

HF's `DynamicCache` grows by concatenation, copying every layer's keys and values for each new token.
`PreallocatedLayer` writes new positions into buffers sized for the whole generation and hands the
model views of the filled part, so the attention sees exactly the tensors it would see with
`DynamicCache` (same values, same length). `batch_select_indices` keeps only some rows (finished rows
leave the decode batch).
"""

from __future__ import annotations

import functools

import torch
from transformers.cache_utils import Cache, DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """One attention layer's cache: buffers [B, H, capacity, D] allocated at the first update; `keys` and
    `values` are views [B, H, length, D] of them."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity, self.length = capacity, 0
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the buffers with the batch, heads, head dims, dtype and device of the first states."""
        self.device = key_states.device
        self._key_buffer = key_states.new_empty(*key_states.shape[:2], self.capacity, key_states.shape[-1])
        self._value_buffer = value_states.new_empty(*value_states.shape[:2], self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append key/value states [B, H, T, D] in place; returns the views [B, H, length + T, D]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise ValueError(f"KV cache of {self.capacity} positions cannot hold {end}")
        self._key_buffer[:, :, self.length : end] = key_states
        self._value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self._expose()
        return self.keys, self.values

    def _expose(self) -> None:
        self.keys = self._key_buffer[:, :, : self.length]
        self.values = self._value_buffer[:, :, : self.length]

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows `indices` [B'] (int64, on the cache's device), in that order."""
        if self.is_initialized:
            self._key_buffer = self._key_buffer.index_select(0, indices)
            self._value_buffer = self._value_buffer.index_select(0, indices)
            self._expose()

    def reset(self) -> None:
        super().reset()
        self.length, self._key_buffer, self._value_buffer = 0, None, None


class PreallocatedCache(Cache):
    """A cache whose every layer is a `PreallocatedLayer` of `capacity` positions (full attention, as
    `DynamicCache()` without a config).

    `keep_decode_mask`: HF drops the attention mask of a one-token step whose rows have no padding and lets
    SDPA run unmasked, which rounds differently from the masked kernel. A batch that had padding keeps
    its mask when the rows left after dropping finished ones have none, so their logits stay bit-identical
    to the whole batch's (with one BLAS thread; several may round the last bit differently). (transformers keeps the mask of a one-token step for caches that report
    `is_compileable`, a flag nothing else on this path reads.)
    """

    def __init__(self, capacity: int, *, keep_decode_mask: bool) -> None:
        super().__init__(layer_class_to_replicate=functools.partial(PreallocatedLayer, capacity))
        self.keep_decode_mask = keep_decode_mask

    @property
    def is_compileable(self) -> bool:
        return self.keep_decode_mask
