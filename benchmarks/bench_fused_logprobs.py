"""LM-head logprobs, forward + backward: eager torch vs chunked torch vs the fused Triton kernel.

Prints, per N, the time and extra memory of (a) eager logits + log_softmax, (b) token-chunked torch with
recomputation, (c) `fused_logprobs`, (d) `fused_logprobs` on a weight carrying Megatron DDP's fp32
`main_grad` (the weight gradient accumulated in place, no [V, H] fp32 buffer), and the time of the three
LM-head GEMMs alone (logits, grad hidden, grad weight) as the floor; ratios are against the eager
baseline / GEMM floor of the same run.

    python benchmarks/bench_fused_logprobs.py            # GPU: N in {1k, 4k, 8k}, H=4096, V=151936, bf16
    python benchmarks/bench_fused_logprobs.py --small    # CPU: tiny sizes, Triton interpreter, memory model

Memory: on GPU the measured peak allocation beyond the inputs, the [N] outputs and the gradients; on CPU
(no allocator statistics) the analytic model below. Interpreter times measure numpy, not the kernel.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

from megatron_armor.kernels import fused_logprobs  # noqa: E402
from megatron_armor.kernels.reference import chunked_logprobs, reference_logprobs  # noqa: E402
from megatron_armor.kernels.tiles import TileConfig, default_tiles  # noqa: E402

FP32 = 4


def model_extra_bytes(name: str, n: int, v: int, h: int, chunk: int, tiles: TileConfig | None = None) -> int:
    """Analytic extra memory (lower bound for the torch paths): eager saves the [N, V] fp32 log-softmax and
    materialises its gradient; chunked does so for one chunk; fused keeps only [N] vectors in memory (its
    tiles live in registers / shared memory) -- 4 statistics per vocab split plus lse, entropy, logprobs,
    labels and two upstream gradients."""
    if name == "eager":
        return 2 * n * v * FP32
    if name == "chunked":
        return 2 * min(chunk, n) * v * FP32
    tiles = tiles or default_tiles(n, v, h)
    return (4 * tiles.vocab_splits(n, v) + 6) * n * FP32


def tile_buffer_bytes(n: int, v: int, h: int) -> int:
    """On-chip working set of one fused program: a logit / gradient tile plus its operand chunks."""
    t = default_tiles(n, v, h)
    return (t.block_n * t.block_v + (t.block_n + t.block_v) * t.block_h) * FP32


def timed(fn: Callable[[], None], device: torch.device, repeats: int) -> tuple[float, int]:
    """(median seconds, peak bytes allocated beyond the memory in use at the start; -1 on CPU)."""
    fn()  # warm-up: compilation, autotuning, allocator
    times, peak = [], -1
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = max(peak, torch.cuda.max_memory_allocated() - base)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], peak


def bench_one(n: int, v: int, h: int, dtype: torch.dtype, device: torch.device, chunk: int, repeats: int) -> None:
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, h, device=device, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, device=device, generator=g) / h**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), device=device, generator=g)
    grad_logits = torch.randn(n, v, device=device, generator=g).to(dtype)
    ddp_weight = weight.detach().clone().requires_grad_()  # as Megatron DDP leaves it: a persistent fp32 buffer
    ddp_weight.main_grad = torch.zeros(v, h, dtype=torch.float32, device=device)
    ddp_weight.grad_added_to_main_grad = False

    def fwd_bwd(impl, w: torch.Tensor = weight) -> Callable[[], None]:
        def run():
            hidden.grad = w.grad = None
            logp, _ = impl(hidden, w, labels)
            logp.sum().backward()
        return run

    def gemms():
        with torch.no_grad():
            hidden.detach() @ weight.detach().T  # logits
            grad_logits @ weight.detach()  # grad hidden
            grad_logits.T @ hidden.detach()  # grad weight

    impls = {
        "eager": fwd_bwd(reference_logprobs),
        "chunked": fwd_bwd(lambda x, w, y: chunked_logprobs(x, w, y, chunk_size=chunk)),
        "fused": fwd_bwd(fused_logprobs),
        "fused+main_grad": fwd_bwd(fused_logprobs, ddp_weight),
    }
    floor, _ = timed(gemms, device, repeats)
    results = {name: timed(fn, device, repeats) for name, fn in impls.items()}
    eager_time, eager_peak = results["eager"]
    eager_model = model_extra_bytes("eager", n, v, h, chunk)
    print(f"\nN={n} H={h} V={v} {str(dtype).removeprefix('torch.')} on {device.type}; GEMMs alone: {floor * 1e3:.2f} ms")
    print(f"{'impl':>15} {'time ms':>10} {'x eager':>8} {'x GEMMs':>8} {'peak extra MiB':>15} {'x eager':>9}"
          f" {'model MiB':>10} {'x eager':>9}")
    for name, (seconds, peak) in results.items():
        model = model_extra_bytes(name, n, v, h, chunk)
        measured = f"{peak / 2**20:15.2f} {peak / max(eager_peak, 1):9.4f}" if peak >= 0 else f"{'n/a':>15} {'':>9}"
        print(f"{name:>15} {seconds * 1e3:10.2f} {seconds / eager_time:8.2f} {seconds / floor:8.2f} {measured}"
              f" {model / 2**20:10.3f} {model / eager_model:9.2e}")
    print(f"fused tile working set per program: {tile_buffer_bytes(n, v, h) / 2**10:.0f} KiB (on chip); "
          f"fp32 gradient accumulators [N, H] + [V, H]: {(n + v) * h * FP32 / 2**20:.1f} MiB (gradient sized); "
          f"with main_grad only [N, H]: {n * h * FP32 / 2**20:.1f} MiB, plus the uninitialised [V, H] "
          f"{str(dtype).removeprefix('torch.')} dummy autograd gets (Megatron's contract)")


def print_gpu_memory_model(ns: list[int], h: int, v: int, chunk: int) -> None:
    """The analytic model at the GPU sizes with the GPU tile defaults (no run)."""
    gpu = TileConfig()
    tiles = f"{gpu.block_n}x{gpu.block_v}x{gpu.block_h}"
    print(f"\nmemory model at H={h} V={v}, GPU tiles {tiles} (goal: fused <= 1/100 eager):")
    for n in ns:
        eager, chunked, fused = (model_extra_bytes(name, n, v, h, chunk, gpu) for name in ("eager", "chunked", "fused"))
        print(f"  N={n:5d}: eager {eager / 2**30:7.3f} GiB, chunked {chunked / 2**30:7.3f} GiB, "
              f"fused {fused / 2**20:7.3f} MiB = {fused / eager:.1e} x eager")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny sizes for a CPU run (Triton interpreter)")
    parser.add_argument("--n", type=int, nargs="+", help="token counts (default 1024 4096 8192; small: 64 256)")
    parser.add_argument("--hidden", type=int, help="H (default 4096; small: 64)")
    parser.add_argument("--vocab", type=int, help="V (default 151936; small: 5000)")
    parser.add_argument("--chunk", type=int, help="token chunk of the chunked torch path (default 1024; small: 64)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    small = args.small or not torch.cuda.is_available()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    sizes = ([64, 256], 64, 5000, 64) if small else ([1024, 4096, 8192], 4096, 151936, 1024)
    ns, h, v, chunk = args.n or sizes[0], args.hidden or sizes[1], args.vocab or sizes[2], args.chunk or sizes[3]
    for n in ns:
        bench_one(n, v, h, torch.bfloat16, device, chunk, args.repeats)
    if small:
        print_gpu_memory_model([1024, 4096, 8192], 4096, 151936, 1024)


if __name__ == "__main__":
    main()
