"""Sequence batches of chosen lengths for the micro-batching and update tests."""

import random

import torch

from megatron_armor.data.types import Sample
from megatron_armor.scoring.batch import build_sequence_batch


def rlvr_lengths(count: int, seed: int, longest: int = 4096) -> list[int]:
    """Prompt + response lengths as RLVR makes them: most responses short, a long tail up to `longest`."""
    rng = random.Random(seed)
    return [min(longest, 64 + int(rng.paretovariate(1.2) * 150)) for _ in range(count)]


def batch_of(lengths: list[int], vocab: int = 96, seed: int = 0, prompt: int = 3):
    """A batch whose row i holds `lengths[i]` tokens (a `prompt`-token prompt, the rest response)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, length in enumerate(lengths):
        ids = torch.randint(1, vocab, (length,), generator=g).tolist()
        samples.append(Sample(i, ids[:prompt], ids[prompt:], torch.randn(length - prompt, generator=g).tolist(), "stop",
                              i % 3 == 0, 1.0, True))
    advantages = torch.randn(len(lengths), generator=g).tolist()
    return build_sequence_batch(samples, advantages, pad_token_id=0)
