"""Trainer offload (rollout.memory.offload_trainer) vs a raw copy of the same bytes, measured in one run.

Builds a Megatron GPTModel actor (default ~115M parameters) with DDP, its Adam optimizer after one
step (so the moments exist) and a frozen reference, then times, best of --repeats:
  - park: weights, optimizer state and grad buffers off the device (one device->host copy of the
    weights and optimizer state; grads are dropped);
  - restore: everything back (one host->device copy, grads re-zeroed).
The baseline of each is one copy of the bytes moved, between preallocated buffers on the same two
devices (the host buffer pinned on a GPU), timed right after the row. Ratio = offload / copy: 1.0
is the floor. On CPU both sides are host memory, so this measures the bookkeeping, not PCIe.

    python benchmarks/bench_offload.py
    python benchmarks/bench_offload.py --hidden 2048 --layers 8
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_models import qwen2_of_width

from megatron_armor.convert.loading import load_gpt_model
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed
from megatron_armor.config import OptimizerConfig
from megatron_armor.models.hf_config import load_model_shape
from megatron_armor.trainer.colocation.offload import TrainerOffload
from megatron_armor.trainer.update.optimizer import optimizer_step, wrap_for_training


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def copy_seconds(nbytes: int, device: torch.device, to_host: bool) -> float:
    """One copy of `nbytes` between preallocated, already-touched buffers on `device` and the host."""
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    source, target = (on_device, host) if to_host else (host, on_device)
    target.copy_(source, non_blocking=True)
    return timed(lambda: target.copy_(source, non_blocking=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model_dir = qwen2_of_width(Path(tempfile.mkdtemp(prefix="bench-offload-")) / "model", hidden=args.hidden,
                               layers=args.layers, vocab=args.vocab)
    ctx = initialize_distributed(1, 1, 1)
    try:
        shape = load_model_shape(model_dir)
        ddp, optimizer = wrap_for_training(OptimizerConfig(), model=load_gpt_model(model_dir, shape, trainable=True))
        ref = load_gpt_model(model_dir, shape)
        for buffer in ddp.buffers:
            buffer.grad_data.normal_(std=1e-3)
        optimizer_step(ddp, optimizer, lr=1e-6)  # Adam moments exist from here on
        offload = TrainerOffload(ddp, optimizer, {"ref": ref})
        offload.park()
        moved = sum(park.parked_bytes for park in (*offload.weights.values(), offload.training_state))
        offload.restore()
        print(f"device {ctx.device}; {moved / 2**20:.0f} MiB copied each way (weights of actor and reference, Adam "
              f"state); torch {torch.__version__}, {torch.get_num_threads()} threads")
        print(f"{'direction':<36}{'offload s':>10}{'copy s':>9}{'ratio':>8}{'GB/s':>8}")
        for label, action, to_host in (("park (device -> host)", offload.park, True),
                                       ("restore (host -> device)", offload.restore, False)):
            prepare = offload.restore if to_host else offload.park
            seconds = []
            for _ in range(args.repeats):
                prepare()
                seconds.append(timed(action))
            best = min(seconds)
            raw = min(copy_seconds(moved, ctx.device, to_host) for _ in range(args.repeats))
            print(f"{label:<36}{best:10.3f}{raw:9.3f}{best / raw:8.2f}{moved / best / 1e9:8.2f}")
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
