"""Exchanging rollout samples between ranks: `all_gather_samples` (packed tensors) vs `dist.all_gather_object`.

Each of --nproc gloo processes on this CPU holds its round-robin share of an RLVR-like generation batch
(--samples samples, prompts 50..300 tokens, responses 100..--max-response tokens, long-tailed: most short, a tail
to the maximum; token ids below 151k, float logprobs) and every rank must end with all of them, as
`generate_samples` needs. Each exchange is timed from a barrier to the slowest rank's end (pickle/pack, the
collectives, unpickle/unpack), best of --repeats; the ratio is packed / all_gather_object, measured in this run.
Both results are checked equal.

    python benchmarks/bench_sample_exchange.py                        # 2 ranks, 512 samples
    python benchmarks/bench_sample_exchange.py --nproc 4 --samples 1024 --max-response 8000
"""

from __future__ import annotations

import argparse
import os
import pickle
import random
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_armor.data.types import Sample
from megatron_armor.distributed.sample_exchange import all_gather_samples, pack_samples
from megatron_armor.utils.net import free_port


def rlvr_batch(count: int, max_response: int, seed: int) -> list[Sample]:
    """`count` samples whose response lengths follow 100 + (max - 100) * u**4 (mean ~ a fifth of the maximum)."""
    rng = random.Random(seed)
    batch = []
    for i in range(count):
        response = 100 + int((max_response - 100) * rng.random() ** 4)
        batch.append(Sample(
            prompt_index=i // 8, prompt_ids=[rng.randrange(151_000) for _ in range(rng.randrange(50, 300))],
            response_ids=[rng.randrange(151_000) for _ in range(response)],
            engine_logprobs=[-rng.expovariate(2.0) for _ in range(response)],
            finish_reason="length" if response == max_response else "stop", is_anchor=i % 8 == 7,
            reward=rng.uniform(-1, 1), correct=rng.random() < 0.5,
        ))
    return batch


def by_object(samples: list[Sample]) -> list[Sample]:
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, samples)
    return [sample for part in gathered for sample in part]


def slowest_seconds(exchange: Callable[[], object]) -> tuple[float, object]:
    """The slowest rank's time from a common barrier to the end of `exchange`, and its result."""
    dist.barrier()
    start = time.perf_counter()
    result = exchange()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed), result


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = rlvr_batch(args.samples, args.max_response, seed=0)[rank::world]
    object_s = packed_s = float("inf")
    for _ in range(args.repeats):  # interleaved, so that a load on the machine weighs on both alike
        seconds, expected = slowest_seconds(lambda: by_object(mine))
        object_s = min(object_s, seconds)
        seconds, packed = slowest_seconds(lambda: all_gather_samples(mine))
        packed_s = min(packed_s, seconds)
        assert packed == expected, "the packed exchange differs from all_gather_object"
    if rank == 0:
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in expected)
        responses = sorted(len(s.response_ids) for s in expected)
        packed_mib = pack_samples(mine).to_words().numel() * 8 / 2**20
        print(f"{world} gloo ranks, {len(expected)} samples, {tokens} tokens (response lengths: median "
              f"{responses[len(responses) // 2]}, max {responses[-1]}); payload of rank 0: pickled "
              f"{len(pickle.dumps(mine)) / 2**20:.2f} MiB, packed {packed_mib:.2f} MiB")
        print(f"{'exchange':<28}{'seconds':>10}{'ratio':>8}")
        print(f"{'all_gather_object':<28}{object_s:10.4f}{1.0:8.2f}")
        print(f"{'all_gather_samples (packed)':<28}{packed_s:10.4f}{packed_s / object_s:8.2f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--max-response", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
                    f"--master-port={free_port()}", __file__, *sys.argv[1:]],
                   env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)


if __name__ == "__main__":
    main()
