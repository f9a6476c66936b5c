"""Per-token logprobs and entropy of (tensor-parallel) Megatron models via Megatron's schedules.

The last pipeline stage turns hidden states into `TokenScores` by one of two heads:
- ``"torch"`` (the CPU default): the output layer gives vocab-sharded logits `[B, S, V/tp]` and the
  log-softmax normaliser is assembled with all-reduces (Megatron's `vocab_parallel_cross_entropy`),
  so no rank materialises full-vocabulary logits, but each holds its `[B, S, V/tp]` shard.
- ``"fused"`` (the GPU default): the Triton kernel (`megatron_armor.kernels.fused_logprobs`) runs on the hidden
  states and the output weight through GPTModel's `output_processor` hook; only `[B, S]` vectors
  are ever held, and under Megatron DDP the weight gradient is added straight into `main_grad`.
  It needs a GPU, or TRITON_INTERPRET=1 on CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_armor.distributed.cpu_compat import megatron_device_scope
from megatron_armor.distributed.device import training_device
from megatron_armor.scoring.batch import SequenceBatch
from megatron_armor.scoring.context_split import ContextSplit, RankShare
from megatron_armor.scoring.micro_batches import MicroBatch, MicroBatching
from megatron_armor.scoring.routes import RoutingPass

LOGPROB_HEADS = ("torch", "fused")


def resolve_logprob_head(head: str) -> str:
    """The head a config's `train.logprob_head` names: "auto" is "fused" when CUDA is available, else "torch"."""
    if head == "auto":
        return "fused" if torch.cuda.is_available() else "torch"
    return head


@dataclass
class TokenScores:
    """logprobs: [b, S] float32 of the labels (differentiable); entropy: [b, S] float32 or None."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None


# loss_fn(scores of the micro-batch, micro_batch) -> (summed loss (0-dim), token count (0-dim int), stats)
LossFn = Callable[[TokenScores, SequenceBatch], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class ScoringConfig:
    """How the last stage scores tokens: sampling temperature, head ("torch" | "fused"), entropy or not.

    Not a config section, and not a copy of one: the arguments of one scoring pass (a teacher server scores at
    each request's temperature, each pass chooses `with_entropy`). A training run's settings join two sections
    (`trainer/run/build.py`'s `_scoring`): the temperature of rollout.sampling and train.logprob_head resolved for
    this machine.
    """

    temperature: float = 1.0
    head: str = "torch"
    with_entropy: bool = False

    def __post_init__(self) -> None:
        if self.head not in LOGPROB_HEADS:
            raise ValueError(f"unknown logprob head {self.head!r}; choose one of {LOGPROB_HEADS}")


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T)[labels] over the full vocabulary, differentiable.

    logits: [B, S, V/tp] this rank's vocab shard; labels: [B, S] int64 global ids -> [B, S] float32.
    """
    scaled = logits.float() / temperature  # a fresh tensor: Megatron's CE works on it in place
    return -tensor_parallel.vocab_parallel_cross_entropy(scaled, labels)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / T) over the full vocabulary. logits [B, S, V/tp] -> [B, S]."""
    group = parallel_state.get_tensor_model_parallel_group()
    scaled = logits.float() / temperature
    logits_max = scaled.amax(dim=-1)
    dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
    shifted = scaled - logits_max.unsqueeze(-1)
    exp = shifted.exp()
    sums = torch.stack([exp.sum(-1), (exp * shifted).sum(-1)])  # one all-reduce for both
    dist.all_reduce(sums, group=group)
    sum_exp, sum_exp_shifted = sums
    return sum_exp.log() - sum_exp_shifted / sum_exp


def forward_backward(
    model: torch.nn.Module, micro_batches: Sequence[MicroBatch], loss_fn: LossFn, *, scoring: ScoringConfig,
    forward_only: bool, routing: RoutingPass | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Run Megatron's schedule (no pipelining or 1F1B, per parallel_state) over `micro_batches`.

    Each micro-batch is moved to `training_device()` (the model's) before the forward, so the model
    and `loss_fn` see it there; a packed one runs packed and `loss_fn` gets its scores as rows
    (`MicroBatch.unpack`). Micro-batches may differ in shape (under pipeline parallelism the stages exchange
    each activation's shape: `variable_seq_lengths`). Returns the stats dict of every micro-batch on the last
    pipeline stage (empty list elsewhere), on that device. Gradients (when not forward_only) accumulate into
    the model; with `calculate_per_token_loss` Megatron's `finalize_model_grads` divides them by the
    total token count. With `routing` (a MoE model) each micro-batch's forward replays its routes and its routers'
    choices are recorded there (`scoring/routes.py`); the stage's forward is done when `chunk` returns, so under PP
    each stage handles its own layers. Under CP the model gets this rank's zig-zag chunks (`scoring/context_split`).
    """
    batches = list(micro_batches)
    mb_size, seq_len = batches[0].model_tokens[0].shape
    device = training_device()

    split = ContextSplit.current()

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator).to(device, non_blocking=True)  # host-to-GPU (or no-op): safe to overlap
        input_ids, position_ids, labels, packing = mb.model_tokens
        share = None
        if split is not None:
            share = split.share(input_ids, labels, packing)
            input_ids, position_ids, labels, packing = share.input_ids, share.position_ids, share.labels, share.packing
        if routing is not None:
            routing.before(mb, share)
        if scoring.head == "fused":
            output = chunk(input_ids, position_ids, None, packed_seq_params=packing,
                           output_processor=_fused_head(scoring), output_processor_context=labels)
            head = lambda scores: _rows_loss(loss_fn, scores, mb, split, share)  # noqa: E731
        else:
            output = chunk(input_ids, position_ids, None, packed_seq_params=packing)
            head = lambda logits: _rows_loss(  # noqa: E731
                loss_fn, _torch_head(logits, labels, scoring), mb, split, share)
        if routing is not None:
            routing.after(mb, share)
        return output, head

    with megatron_device_scope():
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(batches),
            model=[model],
            num_microbatches=len(batches),
            seq_length=seq_len,
            micro_batch_size=mb_size,
            forward_only=forward_only,
        )


def _rows_loss(loss_fn: LossFn, scores: TokenScores, mb: MicroBatch, split: ContextSplit | None,
               share: RankShare | None):
    """`loss_fn` on the micro-batch's rows: its scores unpacked, under CP first gathered from the CP ranks' `share`s
    (the units counted once over the CP group)."""
    if split is None:
        return loss_fn(_unpack(scores, mb), mb.rows)
    entropy = None if scores.entropy is None else share.tokens.gather(scores.entropy)
    loss, units, stats = loss_fn(_unpack(TokenScores(share.tokens.gather(scores.logprobs), entropy), mb), mb.rows)
    return loss, split.count_once(units), stats


def _torch_head(logits: torch.Tensor, labels: torch.Tensor, scoring: ScoringConfig) -> TokenScores:
    """Scores of `labels` [b, S] from vocab-sharded logits [b, S, V/tp]."""
    entropy = token_entropy(logits, scoring.temperature) if scoring.with_entropy else None
    return TokenScores(token_logprobs(logits, labels, scoring.temperature), entropy)


def _unpack(scores: TokenScores, mb: MicroBatch) -> TokenScores:
    """Scores of a micro-batch's model tokens as its rows [n, s] (a packed micro-batch's are [1, T])."""
    entropy = None if scores.entropy is None else mb.unpack(scores.entropy)
    return TokenScores(mb.unpack(scores.logprobs), entropy)


def _fused_head(scoring: ScoringConfig) -> Callable:
    """GPTModel `output_processor`: hidden [S, b, H] ([S/tp, b, H] under sequence parallelism, gathered here) +
    this rank's output weight shard + the labels [b, S] (its context) -> TokenScores.

    Rows of the (padded) weight past the real vocabulary, `output_layer.unpadded_vocab_size` (set by
    `models.gpt.build_gpt_model`), are left out of the softmax, as the torch head's mask does.
    """
    from megatron_armor.kernels import fused_logprobs

    def process(hidden_states, output_layer, output_weight, context: torch.Tensor, **_):
        weight = output_layer.weight if output_weight is None else output_weight
        if output_layer.sequence_parallel:  # [S/tp, b, H] -> [S, b, H]; the kernel all-reduces grad_hidden over TP,
            # so the backward keeps this rank's sequence slice of it (no reduce-scatter)
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False
            )
        b, s = context.shape  # the labels
        hidden = hidden_states.transpose(0, 1).reshape(b * s, -1)  # [b*S, H]
        logprobs, entropy = fused_logprobs(
            hidden, weight, context.reshape(-1), temperature=scoring.temperature,
            vocab_size=output_layer.unpadded_vocab_size, tp_group=parallel_state.get_tensor_model_parallel_group(),
        )
        return TokenScores(logprobs.view(b, s), entropy.view(b, s) if scoring.with_entropy else None)

    return process


@dataclass
class LogprobResult:
    """logprobs: [B, S] float32 label-aligned; entropy: [B, S] float32 or None (both 0 off-response)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None


@torch.no_grad()
def compute_logprobs(
    model: torch.nn.Module, batch: SequenceBatch, *, micro_batching: MicroBatching, scoring: ScoringConfig,
    routing: RoutingPass | None = None,
) -> LogprobResult:
    """Logprobs (and entropy if `scoring.with_entropy`) of `batch.labels` under `model`, forward
    only, identical on every rank; scored on the training device in `micro_batching`'s micro-batches, returned
    on `batch`'s device as [B, S] rows of `batch`; routed as `routing` says (`forward_backward`)."""

    def collect(scores: TokenScores, mb: SequenceBatch):
        return scores.logprobs.new_zeros(()), scores.logprobs.new_zeros((), dtype=torch.int), masked_scores(scores, mb)

    was_training = model.training
    model.eval()
    micro_batches = micro_batching.split(batch)
    outputs = forward_backward(model, micro_batches, collect, scoring=scoring, forward_only=True, routing=routing)
    model.train(was_training)
    return gather_scores(outputs, micro_batches, batch, with_entropy=scoring.with_entropy)


def masked_scores(scores: TokenScores, rows: SequenceBatch) -> dict[str, torch.Tensor]:
    """A micro-batch's detached scores on its response tokens, as loss-callback stats for `gather_scores`:
    {"scores/logprobs": [n, s], "scores/entropy": [n, s] (with entropy)}, 0 off the response."""
    stats = {"scores/logprobs": scores.logprobs.detach() * rows.response_mask}
    if scores.entropy is not None:
        stats["scores/entropy"] = scores.entropy.detach() * rows.response_mask
    return stats


def gather_scores(
    outputs: list[dict[str, torch.Tensor]], micro_batches: Sequence[MicroBatch], batch: SequenceBatch, *,
    with_entropy: bool,
) -> LogprobResult:
    """The `masked_scores` of every micro-batch of `batch` (the schedule's `outputs`: on the last pipeline stage
    only) as [B, S] rows of `batch`, on every stage (collective over the pipeline group) and `batch`'s device."""
    keys = ["scores/logprobs"] + (["scores/entropy"] if with_entropy else [])
    result, device = {}, training_device()  # stages without outputs receive the last stage's there
    for key in keys:
        values = torch.zeros(batch.input_ids.shape, device=device)
        for out, mb in zip(outputs, micro_batches):  # no outputs off the last stage
            values[mb.row_index.to(device), : out[key].shape[1]] = out[key]
        result[key] = _broadcast_from_last_stage(values).to(batch.input_ids.device)
    return LogprobResult(logprobs=result["scores/logprobs"], entropy=result.get("scores/entropy"))


def _broadcast_from_last_stage(values: torch.Tensor) -> torch.Tensor:
    """Share a tensor computed on the last pipeline stage with the other stages (no-op without PP)."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return values
    dist.broadcast(
        values,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return values
