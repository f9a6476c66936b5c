"""Worker: fused_logprobs / fused_armor_loss on one vocab shard per rank (gloo) vs torch on the full weight.

argv: out_dir. Every rank builds the same problem, runs the kernels on its rows of the weight with the world
as the tensor-parallel group, and reports max errors (forward absolute, gradients relative to their scale).
"""

import os
import sys

import torch
import torch.distributed as dist

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
tests_dir = __file__.rsplit("/workers/", 1)[0]
sys.path[:0] = [tests_dir, f"{tests_dir}/kernels"]
from kernel_cases import make_case  # noqa: E402
from launcher import write_result  # noqa: E402

from megatron_armor.kernels import fused_armor_loss, fused_logprobs  # noqa: E402
from megatron_armor.kernels.reference import reference_armor_loss, reference_logprobs  # noqa: E402

LOSS = dict(alpha=0.9375, clip_low=0.2, clip_high=0.28, dual_clip=3.0, temperature=0.7)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected).abs().max() / expected.abs().max()).item()


def leaves(case, rows: slice) -> tuple[torch.Tensor, ...]:
    """Fresh leaf copies: hidden and this rank's weight shard in the case dtype, hidden and full weight in fp32."""
    leaf = lambda t, dtype: t.detach().to(dtype, copy=True).requires_grad_()  # noqa: E731
    dtype = case.hidden.dtype
    return (leaf(case.hidden, dtype), leaf(case.weight[rows], dtype),
            leaf(case.hidden, torch.float32), leaf(case.weight, torch.float32))


def run(dtype: torch.dtype, group: dist.ProcessGroup) -> dict[str, float]:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    case = make_case(37, 1000, 64, dtype, seed=5)
    rows = slice(rank * 1000 // world, (rank + 1) * 1000 // world)
    rl_inputs = (case.old_logp, case.ref_logp, case.advantages, case.mask)
    g = torch.Generator().manual_seed(6)
    grad_logp, grad_entropy = torch.randn(37, generator=g), torch.randn(37, generator=g)
    out = {}

    hidden, shard, ref_hidden, ref_weight = leaves(case, rows)
    logp, entropy = fused_logprobs(hidden, shard, case.labels, temperature=0.7, tp_group=group)
    ref_logp, ref_entropy = reference_logprobs(ref_hidden, ref_weight, case.labels, 0.7)
    (logp * grad_logp + entropy * grad_entropy).sum().backward()
    (ref_logp * grad_logp + ref_entropy * grad_entropy).sum().backward()
    out |= {"logprobs": (logp - ref_logp).abs().max().item(), "entropy": (entropy - ref_entropy).abs().max().item(),
            "logprobs_max": logp.max().item(), "logprobs_grad_hidden": rel_err(hidden.grad, ref_hidden.grad),
            "logprobs_grad_weight": rel_err(shard.grad, ref_weight.grad[rows])}

    hidden, shard, ref_hidden, ref_weight = leaves(case, rows)
    loss, stats = fused_armor_loss(hidden, shard, case.labels, *rl_inputs, tp_group=group, **LOSS)
    ref_loss, ref_stats = reference_armor_loss(ref_hidden, ref_weight, case.labels, *rl_inputs, **LOSS)
    loss.backward()
    ref_loss.backward()
    out |= {"loss": (loss - ref_loss).abs().item(),
            "loss_stats": max((stats[k] - v).abs().item() for k, v in ref_stats.items()),
            "loss_grad_hidden": rel_err(hidden.grad, ref_hidden.grad),
            "loss_grad_weight": rel_err(shard.grad, ref_weight.grad[rows])}
    return out


dist.init_process_group("gloo")
group = dist.new_group(list(range(dist.get_world_size())))
results = {str(dtype).removeprefix("torch."): run(dtype, group) for dtype in (torch.float32, torch.bfloat16)}
write_result(sys.argv[1], results)
dist.destroy_process_group()
