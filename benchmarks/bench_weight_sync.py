"""Weight sync into rollout engines vs a raw memcpy of the same bytes, measured in one run.

Builds an HF Qwen2 checkpoint (default ~115M parameters, ~420 MiB fp32), then times pushing a new
set of its weights through `sync_weights` (pause, flush, push, continue), best of --repeats:
  - into an in-process `LocalEngine` (copy_ into its parameters);
  - into an `http_server` subprocess with each `weight_sync` mode: tensor (/update_weights_from_tensor)
    with each payload (rollout.weight_sync.payload): flattened_bucket (every bucket packed into a
    staging buffer in /dev/shm) and per_tensor (tensors already in shared memory go as handles to their
    own storage, no staging copy); distributed (gloo broadcast, /update_weights_from_distributed; the
    group is formed by the first, untimed-by-best-of repeat); disk (safetensors + /update_weights_from_disk);
  - the trainer's path: a Megatron GPTModel of the same weights (TP 1), gathered to HF names by
    `gather_hf_weights` as `armor train` pushes it, its weights in shared memory as the trainer keeps
    them for per_tensor pushes (split fused QKV tensors are copies, staged).
The baseline is one memcpy of all the bytes into a preallocated buffer, timed right after each row, with
the threads this process has; the server gets as many (the trainer waits while it copies).
Ratio = sync / memcpy (issue goal: <= 1.2).

With --device cuda the weights and the server (`--device cuda`) live on this host's GPU: tensor
pushes travel as CUDA-IPC handles (every CUDA tensor maps without a copy, so per_tensor stages
nothing) and the memcpy is a device-to-device copy. The distributed mode is left out there (NCCL
needs the trainer and the server on different GPUs).

    python benchmarks/bench_weight_sync.py                       # defaults
    python benchmarks/bench_weight_sync.py --hidden 2048 --layers 8 --buckets 64 512
    python benchmarks/bench_weight_sync.py --device cuda --hidden 2048 --layers 8
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from bench_models import qwen2_of_width

from megatron_armor.config import WeightSyncConfig
from megatron_armor.convert.loading import load_gpt_model
from megatron_armor.convert.weights import gather_hf_weights, parameters_exported_as_views
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed
from megatron_armor.models.hf_config import load_model_shape
from megatron_armor.rollout.local import LocalEngine
from megatron_armor.rollout.sglang_engine import SGLangEngine, SGLangEngineConfig
from megatron_armor.rollout.tensor_serialization import share_storages
from megatron_armor.rollout.weight_sync import sync_weights
from megatron_armor.utils.net import free_port


def best_of(repeats: int, fn: Callable[[], float]) -> float:
    return min(fn() for _ in range(repeats))


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def memcpy_seconds(tensors: dict[str, torch.Tensor]) -> float:
    """One copy of all the bytes ([N] uint8) into a preallocated, already-touched buffer on the tensors'
    device: the floor of any sync."""
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()])
    target = torch.empty_like(flat)
    target.copy_(flat)
    synchronize(flat.device)
    return timed(lambda: (target.copy_(flat), synchronize(flat.device)))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def start_server(model_dir: Path, log: Path, device: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "megatron_armor.rollout.http_server", "--model", str(model_dir), "--port", str(port),
           "--device", device]
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())})
    return proc, f"http://127.0.0.1:{port}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--buckets", type=int, nargs="+", default=[64, 512], help="bucket sizes in MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: weights and server on this host's GPU")
    args = parser.parse_args()
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="bench-weight-sync-"))
    model_dir = qwen2_of_width(work / "model", hidden=args.hidden, layers=args.layers, vocab=args.vocab)
    local = LocalEngine(model_dir)
    local.model.to(args.device)
    new = {name: torch.randn_like(p) for name, p in local.named_parameters_hf().items()}
    share_storages(new.values())  # for per_tensor, as the trainer keeps its weights (staged payloads ignore it)
    total = sum(t.nbytes for t in new.values())
    print(f"model: {len(new)} tensors, {total / 2**20:.0f} MiB ({next(iter(new.values())).dtype}); "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}")
    print(f"{'path':<52}{'sync s':>9}{'memcpy s':>9}{'ratio':>8}{'GB/s':>8}")

    def row(label: str, sync: Callable[[], float]) -> None:
        """Best-of times of `sync` and, right after (this box's load varies), of the memcpy baseline."""
        sync_s = best_of(args.repeats, sync)
        raw_s = best_of(args.repeats, lambda: memcpy_seconds(new))
        print(f"{label:<52}{sync_s:9.3f}{raw_s:9.3f}{sync_s / raw_s:8.2f}{total / sync_s / 1e9:8.2f}")

    device = torch.device(args.device)

    def sync_seconds(engine, tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]] = new.items) -> float:
        """`sync_weights` until the copies are done (a GPU queues them; the server answers after its own)."""
        return timed(lambda: (sync_weights(engine, tensors()), synchronize(device)))

    row("LocalEngine (in-process copy_)", lambda: sync_seconds(local))
    ctx = initialize_distributed(1, 1, 1)
    proc, url = start_server(model_dir, work / "server.log", args.device)
    try:
        shape = load_model_shape(model_dir)
        trainer = load_gpt_model(model_dir, shape)
        share_storages(parameters_exported_as_views(trainer, shape))  # as `armor train` does for per_tensor
        gathered = sum(t.nbytes for _, t in gather_hf_weights(trainer, shape))
        assert gathered == total, f"the trainer gathers {gathered} bytes, the HF model has {total}"

        def client(mode: str, mib: float, payload: str = "flattened_bucket") -> SGLangEngine:
            pushes = WeightSyncConfig(method=mode, dir=str(work / "disk"), payload=payload, bucket_mb=mib)
            return SGLangEngine([url], SGLangEngineConfig(startup_timeout_s=300, weight_sync=pushes))

        for payload in ("flattened_bucket", "per_tensor"):
            for mib in args.buckets:
                with contextlib.closing(client("tensor", mib, payload)) as engine:
                    row(f"http_server, tensor {payload}, {mib} MiB", lambda: sync_seconds(engine))
        for payload in ("flattened_bucket", "per_tensor"):
            with contextlib.closing(client("tensor", max(args.buckets), payload)) as engine:
                row(f"trainer -> http_server, tensor {payload}, {max(args.buckets)} MiB",
                    lambda: sync_seconds(engine, lambda: gather_hf_weights(trainer, shape)))
        disk = [("disk", 2 ** -20)]  # 1-byte buckets: a file per tensor
        for mode, mib in [("distributed", b) for b in args.buckets if device.type == "cpu"] + disk:
            with contextlib.closing(client(mode, mib)) as engine:
                row(f"http_server, {mode}" + (f", {mib} MiB" if mode != "disk" else ""), lambda: sync_seconds(engine))
    finally:
        proc.kill()
        proc.wait()
        destroy_distributed()
    print(f"(device {ctx.device})")


if __name__ == "__main__":
    main()
