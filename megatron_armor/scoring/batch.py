"""Pack scored samples into right-padded token tensors aligned for next-token logprobs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch

from megatron_armor.data.types import Sample


@dataclass
class SequenceBatch:
    """B prompt+response sequences, right-padded to S tokens.

    Position t predicts token t+1, so every per-token tensor is "label aligned":
      input_ids:     [B, S] int64, prompt + response + padding
      labels:        [B, S] int64, input_ids shifted left by one (last column is padding)
      response_mask: [B, S] float32, 1 where labels[:, t] is a response token the policy sampled (all of them
                     unless the sample's `loss_mask` says otherwise: a trajectory's tool results are not)
      engine_logprobs: [B, S] float32, the rollout engine's logprob of labels[:, t] (0 off-response)
      advantages:    [B] float32 (broadcast over tokens by the loss)
      is_anchor:     [B] bool
      old_logprobs / ref_logprobs: [B, S] float32 label-aligned logprobs of the actor before the
                     update and of the reference; filled in by the trainer before the update.
      teacher_logprobs: [B, S] float32 label-aligned logprobs of the OPD teacher (or None).
      token_advantages: [B, S] float32 per-token advantages (OPD), preferred by the loss over
                     `advantages` when set; 0 off-response.
      seq_lengths:   [B] int64 prompt + response tokens of each row (None: every row counts as S long).
      routed_experts: [B, S, L, k] int16 (MoE) the experts token input_ids[:, t] is routed to in each of the L
                     decoder layers, to replay in the actor's forwards (`scoring/routes.py`); -1 where none is
                     recorded (the router chooses); None: no replay. Position-aligned, not label-aligned.
    Right padding with a causal mask leaves real tokens unaffected, so no attention mask is needed
    and position ids are simply 0..S-1. Batches are built on the CPU; `scoring.logprobs.forward_backward`
    moves each micro-batch to the training device.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    response_mask: torch.Tensor
    engine_logprobs: torch.Tensor
    advantages: torch.Tensor
    is_anchor: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    token_advantages: torch.Tensor | None = None
    seq_lengths: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def real_lengths(self) -> torch.Tensor:
        """[B] int64 tokens of each row before its padding (`seq_lengths`, or S when unknown)."""
        if self.seq_lengths is not None:
            return self.seq_lengths
        return torch.full((self.size,), self.input_ids.shape[1], dtype=torch.long)

    @property
    def position_ids(self) -> torch.Tensor:
        """[B, S] int64, on the device of `input_ids`."""
        return torch.arange(self.input_ids.shape[1], device=self.input_ids.device).expand_as(self.input_ids)

    def per_token_advantages(self) -> torch.Tensor:
        """[B, S] float32: `token_advantages`, or the per-sample `advantages` broadcast over tokens."""
        if self.token_advantages is not None:
            return self.token_advantages
        return self.advantages[:, None].expand_as(self.response_mask)

    def select(self, index: slice | torch.Tensor) -> SequenceBatch:
        """The sub-batch of rows `index` (every field indexed along dim 0)."""
        return self._map(lambda tensor: tensor[index])

    def trim(self, width: int) -> SequenceBatch:
        """The first `width` columns of every per-token [B, S, ...] field (per-row fields unchanged)."""
        return self._map(lambda tensor: tensor[:, :width] if tensor.dim() >= 2 else tensor)

    def to(self, device: torch.device, *, non_blocking: bool = False) -> SequenceBatch:
        """This batch with every tensor on `device` (tensors already there are shared, not copied).

        `non_blocking` suits host-to-GPU copies only: a copy back to the host may still be in flight.
        """
        return self._map(lambda tensor: tensor.to(device, non_blocking=non_blocking))

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> SequenceBatch:
        """A batch of `fn` applied to every tensor field (None fields stay None)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return SequenceBatch(**{name: None if v is None else fn(v) for name, v in values.items()})


def build_sequence_batch(
    samples: Sequence[Sample], advantages: Sequence[float], *, pad_token_id: int, pad_to_multiple_of: int = 8
) -> SequenceBatch:
    """Pack `samples` (with per-sample `advantages`) into one `SequenceBatch`; `routed_experts` when some sample
    carries the engine's routes (the positions they cover: the prompt and every response token but the last; -1 in
    the rows of samples without)."""
    if not samples:
        raise ValueError("cannot build a batch from zero samples")
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    seq_len = -(-max(lengths) // pad_to_multiple_of) * pad_to_multiple_of
    input_ids = torch.full((len(samples), seq_len), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros(len(samples), seq_len)
    engine_logprobs = torch.zeros(len(samples), seq_len)
    for row, sample in enumerate(samples):
        tokens = sample.prompt_ids + sample.response_ids
        input_ids[row, : len(tokens)] = torch.tensor(tokens)
        # labels[t] = input_ids[t + 1], so response token j (at position P + j) is label P + j - 1.
        start = len(sample.prompt_ids) - 1
        response_mask[row, start : start + len(sample.response_ids)] = (
            1.0 if sample.loss_mask is None else torch.tensor(sample.loss_mask, dtype=torch.float32))
        engine_logprobs[row, start : start + len(sample.response_ids)] = torch.tensor(sample.engine_logprobs)
    labels = torch.cat([input_ids[:, 1:], torch.full((len(samples), 1), pad_token_id)], dim=1)
    routes = [s.routed_experts for s in samples]
    return SequenceBatch(
        input_ids=input_ids,
        labels=labels,
        response_mask=response_mask,
        engine_logprobs=engine_logprobs,
        advantages=torch.tensor(advantages, dtype=torch.float32),
        is_anchor=torch.tensor([s.is_anchor for s in samples], dtype=torch.bool),
        seq_lengths=torch.tensor(lengths, dtype=torch.long),
        routed_experts=None if all(r is None for r in routes) else _route_table(routes, seq_len),
    )


def _route_table(routes: Sequence[torch.Tensor | None], width: int) -> torch.Tensor:
    """Per-sample routes [N_i, L, k] (or None) as one [B, width, L, k] int16 table, -1 past each sample's N_i."""
    shape = next(route.shape[1:] for route in routes if route is not None)
    table = torch.full((len(routes), width, *shape), -1, dtype=torch.int16)
    for row, route in enumerate(routes):
        if route is not None:
            table[row, : route.shape[0]] = route
    return table

