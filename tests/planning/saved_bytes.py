"""The bytes autograd actually saves for backward during a forward of a Megatron GPTModel plus its LM head's
logprobs (the tensors `torch.autograd.graph.saved_tensors_hooks` sees, storages counted once by data_ptr,
parameters left out), and the planner's estimate of the same, for the tests and the TP=2 / CP=2 worker."""

from __future__ import annotations

import torch

from megatron_armor.distributed.cpu_compat import megatron_device_scope
from megatron_armor.models.hf_config import ModelShape
from megatron_armor.planning.activations import activation_bytes, logits_bytes
from megatron_armor.planning.memory import Layout
from megatron_armor.scoring.context_split import ContextSplit
from megatron_armor.scoring.logprobs import ScoringConfig, _fused_head, token_logprobs


def measured_saved_bytes(model: torch.nn.Module, tokens: torch.Tensor, head: str) -> int:
    """Bytes of the distinct non-parameter storages saved for backward by a forward of `model` on `tokens`
    [b, S] and the logprobs of `head` ("torch" | "fused") on them (under context parallelism, on this CP rank's
    chunks of them); the graph is freed before returning."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params and storage.nbytes():
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    positions, labels = torch.arange(tokens.shape[1]).expand_as(tokens), tokens
    split = ContextSplit.current()
    if split is not None:  # under context parallelism: this rank's zig-zag chunks, as the trainer feeds them
        share = split.share(tokens, labels)
        tokens, positions, labels = share.input_ids, share.position_ids, share.labels
    with megatron_device_scope(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        if head == "fused":
            scores = model(tokens, positions, None, output_processor=_fused_head(ScoringConfig(head="fused")),
                           output_processor_context=labels)  # the fused head's context: the labels
            logprobs = scores.logprobs
        else:
            logprobs = token_logprobs(model(tokens, positions, None), labels)
    del logprobs
    return sum(saved.values())


def estimated_saved_bytes(shape: ModelShape, layout: Layout, tokens: int) -> int:
    """The planner's saved-for-backward bytes of one micro-batch (decoder layers, final norm, LM head)."""
    return activation_bytes(shape, layout, tokens, micro_batches=1).saved + logits_bytes(shape, layout, tokens).saved
