"""Weight sync into rollout engines vs a raw copy of the same bytes, measured in one run.

Builds an HF Qwen2 checkpoint (default ~115M parameters, ~460 MB fp32), then times pushing a new
set of its weights through `sync_weights`:
  (a) into an `http_server` subprocess over SGLang's /update_weights_from_tensor (flattened_bucket),
      for several bucket sizes, against the same bytes sent raw over a loopback TCP socket;
  (b) into an in-process `LocalEngine`, against `copy_` into preallocated tensors.
Each time is the best of --repeats. The ratio column is sync / raw (goal: <= 1.2).

    python benchmarks/bench_weight_sync.py                       # defaults
    python benchmarks/bench_weight_sync.py --hidden 2048 --layers 8 --buckets 64 512
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_armor.models.tiny import make_tiny_checkpoint
from megatron_armor.rollout.local import LocalEngine
from megatron_armor.rollout.sglang_engine import SGLangEngine, SGLangEngineConfig
from megatron_armor.rollout.weight_sync import sync_weights


def best_of(repeats: int, fn: Callable[[], float]) -> float:
    return min(fn() for _ in range(repeats))


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def raw_copy_seconds(tensors: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> float:
    """copy_ of every tensor into its preallocated twin: the in-process floor."""
    def copy() -> None:
        for name, tensor in tensors.items():
            targets[name].copy_(tensor)
    return timed(copy)


def raw_loopback_seconds(payload: torch.Tensor, chunk: int = 8 << 20) -> float:
    """Send `payload` ([N] uint8) over a loopback TCP socket into a preallocated buffer: the HTTP path's floor."""
    sink = bytearray(payload.numel())
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def receive() -> None:
            conn, _ = server.accept()
            with conn:
                view, got = memoryview(sink), 0
                while got < len(sink):
                    got += conn.recv_into(view[got:], min(chunk, len(sink) - got))
                conn.sendall(b"k")

        thread = threading.Thread(target=receive)
        thread.start()
        start = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(memoryview(payload.numpy()))
            client.recv(1)
        seconds = time.perf_counter() - start
        thread.join()
    return seconds


def start_server(model_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "megatron_armor.rollout.http_server", "--model", str(model_dir), "--port", str(port)]
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc, f"http://127.0.0.1:{port}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--buckets", type=int, nargs="+", default=[64, 256, 512], help="bucket sizes in MiB")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="bench-weight-sync-"))
    model_dir = make_tiny_checkpoint(
        work / "model", hidden_size=args.hidden, num_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256), intermediate_size=args.hidden * 11 // 4,
        vocab_size=args.vocab, max_position_embeddings=512,
    )
    local = LocalEngine(model_dir)
    new = {name: torch.randn_like(p) for name, p in local.named_parameters_hf().items()}
    total = sum(t.nbytes for t in new.values())
    print(f"model: {len(new)} tensors, {total / 2**20:.0f} MiB ({next(iter(new.values())).dtype}); "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'path':<44}{'sync s':>9}{'raw s':>9}{'ratio':>8}{'GB/s':>8}")

    def row(label: str, sync_s: float, raw_s: float) -> None:
        print(f"{label:<44}{sync_s:9.3f}{raw_s:9.3f}{sync_s / raw_s:8.2f}{total / sync_s / 1e9:8.2f}")

    targets = {name: torch.empty_like(t) for name, t in new.items()}
    raw = best_of(args.repeats, lambda: raw_copy_seconds(new, targets))
    row("LocalEngine (in-process) vs copy_", best_of(args.repeats, lambda: sync_weights(local, new.items()).seconds), raw)

    proc, url = start_server(model_dir, work / "server.log")
    try:
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in new.values()])
        raw = best_of(args.repeats, lambda: raw_loopback_seconds(flat))
        for mib in args.buckets:
            engine = SGLangEngine([url], SGLangEngineConfig(bucket_bytes=mib << 20, startup_timeout_s=300))
            sync = best_of(args.repeats, lambda: sync_weights(engine, new.items()).seconds)
            row(f"http_server, {mib} MiB buckets vs loopback TCP", sync, raw)
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    main()
