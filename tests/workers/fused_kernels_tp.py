"""Worker: fused_logprobs / fused_armor_loss on one vocab shard per rank (gloo) vs torch on the full weight.

argv: out_dir. Every rank builds the same problems, runs the kernels on its rows of the weight with the world
as the tensor-parallel group, and reports max errors (forward absolute, gradients relative to their scale)
per vocabulary layout and dtype. Padded layouts append padding rows (`pad_vocab`) to the real vocabulary,
as Megatron does, and tell the kernels the real size; the reference sees only the real rows.
"""

import os
import sys

import torch
import torch.distributed as dist

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
tests_dir = __file__.rsplit("/workers/", 1)[0]
sys.path[:0] = [tests_dir, f"{tests_dir}/kernels"]
from kernel_cases import make_case, pad_vocab, randn  # noqa: E402
from launcher import write_result  # noqa: E402

from megatron_armor.kernels import fused_armor_loss, fused_logprobs  # noqa: E402
from megatron_armor.kernels.reference import reference_armor_loss, reference_logprobs  # noqa: E402

LOSS = dict(alpha=0.9375, clip_low=0.2, clip_high=0.28, dual_clip=3.0, temperature=0.7)
# name: (real vocabulary rows, weight rows over all ranks). With 2 ranks of 512 rows: padding inside the
# last shard only; padding from inside the first shard through the whole second one (it holds no real row).
LAYOUTS = {"unpadded": (1000, 1000), "padded-last-shard": (1000, 1024), "padded-both-shards": (450, 1024)}


def rel_err(actual: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor) -> float:
    return ((actual.float() - expected).abs().max() / scale.abs().max()).item()


def weight_grad_errors(prefix: str, shard_grad: torch.Tensor, ref_grad: torch.Tensor, rows: slice,
                       total_rows: int) -> dict[str, float]:
    """This shard's weight gradient against the reference's rows, zero-padded to `total_rows` (relative to the
    full reference gradient's scale), and the sum of |gradient| over its padding rows, which must be exactly 0."""
    vocab = ref_grad.shape[0]
    expected = torch.cat([ref_grad, ref_grad.new_zeros(total_rows - vocab, ref_grad.shape[1])])[rows]
    first_padding = min(max(vocab - rows.start, 0), shard_grad.shape[0])
    return {f"{prefix}_grad_weight": rel_err(shard_grad, expected, ref_grad),
            f"{prefix}_grad_padding": shard_grad[first_padding:].abs().sum().item()}


def leaves(hidden: torch.Tensor, shard: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Fresh leaf copies: hidden and this rank's weight shard as given, hidden and the real weight in fp32."""
    leaf = lambda t, dtype: t.detach().to(dtype, copy=True).requires_grad_()  # noqa: E731
    return leaf(hidden, hidden.dtype), leaf(shard, shard.dtype), leaf(hidden, torch.float32), leaf(weight, torch.float32)


def run(dtype: torch.dtype, group: dist.ProcessGroup, vocab: int, total_rows: int) -> dict[str, float]:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    case = make_case(37, vocab, 64, dtype, seed=5)
    rows = slice(rank * total_rows // world, (rank + 1) * total_rows // world)
    shard = pad_vocab(case.weight, total_rows - vocab)[rows]
    rl_inputs = (case.old_logp, case.ref_logp, case.advantages, case.mask)
    grad_logp, grad_entropy = randn(2, 37, seed=6)
    out = {}

    hidden, local, ref_hidden, ref_weight = leaves(case.hidden, shard, case.weight)
    logp, entropy = fused_logprobs(hidden, local, case.labels, temperature=0.7, vocab_size=vocab, tp_group=group)
    ref_logp, ref_entropy = reference_logprobs(ref_hidden, ref_weight, case.labels, 0.7)
    (logp * grad_logp + entropy * grad_entropy).sum().backward()
    (ref_logp * grad_logp + ref_entropy * grad_entropy).sum().backward()
    out |= {"logprobs": (logp - ref_logp).abs().max().item(), "entropy": (entropy - ref_entropy).abs().max().item(),
            "logprobs_max": logp.max().item(),
            "logprobs_grad_hidden": rel_err(hidden.grad, ref_hidden.grad, ref_hidden.grad),
            **weight_grad_errors("logprobs", local.grad, ref_weight.grad, rows, total_rows)}

    hidden, local, ref_hidden, ref_weight = leaves(case.hidden, shard, case.weight)
    loss, stats = fused_armor_loss(hidden, local, case.labels, *rl_inputs, vocab_size=vocab, tp_group=group, **LOSS)
    ref_loss, ref_stats = reference_armor_loss(ref_hidden, ref_weight, case.labels, *rl_inputs, **LOSS)
    loss.backward()
    ref_loss.backward()
    out |= {"loss": (loss - ref_loss).abs().item(),
            "loss_stats": max((stats[k] - v).abs().item() for k, v in ref_stats.items()),
            "loss_grad_hidden": rel_err(hidden.grad, ref_hidden.grad, ref_hidden.grad),
            **weight_grad_errors("loss", local.grad, ref_weight.grad, rows, total_rows)}
    return out


dist.init_process_group("gloo")
group = dist.new_group(list(range(dist.get_world_size())))
results = {f"{layout}/{str(dtype).removeprefix('torch.')}": run(dtype, group, *LAYOUTS[layout])
           for layout in LAYOUTS for dtype in (torch.float32, torch.bfloat16)}
write_result(sys.argv[1], results)
dist.destroy_process_group()
