"""Worker: `all_gather_samples` against `dist.all_gather_object` (gloo), for ranks holding different numbers of
samples, one of them none.

argv: out_dir. Writes, per case, whether the packed exchange gave exactly all_gather_object's samples (floats
compared by their bits) and the gathered samples themselves (floats as float.hex), for comparison across ranks.
"""

import dataclasses
import random
import sys

import torch.distributed as dist

from megatron_armor.data.types import Sample
from megatron_armor.distributed.sample_exchange import all_gather_samples

sys.path.insert(0, __file__.rsplit("/workers/", 1)[0])
from launcher import write_result  # noqa: E402

CASES = {"one_rank_empty": (0, 5), "uneven": (3, 7), "all_empty": (0, 0)}
ODD_FLOATS = [-0.0, float("-inf"), 5e-324, -1e-30]  # signed zero, infinity, a subnormal, a tiny value


def rank_samples(rank: int, count: int) -> list[Sample]:
    """`count` samples of one rank: response lengths 0.., anchors, int64 extremes, odd floats, and (every third)
    a trajectory's loss mask; trajectory numbers, two samples each (a forked trajectory's segments), or none."""
    rng = random.Random(rank)
    samples = []
    for i in range(count):
        response = [rng.randrange(2**63) for _ in range(i * 3)] + ([2**63 - 1] if i % 2 else [])
        logprobs = [-rng.expovariate(1.0) for _ in response[:-4]] + ODD_FLOATS[: len(response) - len(response[:-4])]
        samples.append(Sample(prompt_index=rank * 100 + i, prompt_ids=[rng.randrange(151_000) for _ in range(i + 1)],
                              response_ids=response, engine_logprobs=logprobs, finish_reason=("stop", "length")[i % 2],
                              is_anchor=i % 3 == 0, reward=rng.uniform(-2, 2), correct=i % 2 == 0,
                              loss_mask=[rng.randrange(2) for _ in response] if i % 3 == 1 else None,
                              trajectory=i // 2 if i % 4 else None))
    return samples


def plain(sample: Sample) -> dict:
    """The sample with its floats as hex strings (exact bits; -0.0 differs from 0.0)."""
    fields = dataclasses.asdict(sample)
    return {**fields, "engine_logprobs": [x.hex() for x in sample.engine_logprobs], "reward": sample.reward.hex()}


dist.init_process_group("gloo")
rank, result = dist.get_rank(), {}
for name, counts in CASES.items():
    mine = rank_samples(rank, counts[rank])
    by_object: list = [None] * dist.get_world_size()
    dist.all_gather_object(by_object, mine)
    packed = all_gather_samples(mine)
    expected = [plain(s) for part in by_object for s in part]
    result[name] = {"same_as_all_gather_object": [plain(s) for s in packed] == expected, "samples": expected}
write_result(sys.argv[1], result)
dist.destroy_process_group()
