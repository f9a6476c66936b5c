"""Update-pass cost of one rank's batch, cut four ways: padded, fixed-size trimmed, token budget, packed.

On an RLVR-like length mix (most responses short, a long tail to the maximum) it prints, per micro-batching,
the tokens the model computes per real token and the time of a forward + backward of the policy loss over the
whole batch (a real Megatron GPTModel in one process), with ratios against the padded baseline of the same
run:
- padded: `micro_batch_size` rows per micro-batch, every one padded to the batch's longest row (what the
  trainer did before token budgets: one padded tensor per rank, sliced);
- fixed: the same micro-batches, each trimmed to its own longest row;
- budget: `--max-tokens` per micro-batch, binned first-fit decreasing, each padded to its own longest row;
- packed: the same budget, each micro-batch packed (THD) so that no padding token is computed.

    python benchmarks/bench_micro_batching.py                  # CPU: 64 sequences up to 1024 tokens
    python benchmarks/bench_micro_batching.py --sequences 256 --max-len 4096 --hidden 1024 --layers 8  # GPU
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch

from megatron_armor.config import MicroBatchingConfig
from megatron_armor.convert.loading import load_gpt_model
from megatron_armor.data.types import Sample
from megatron_armor.distributed.device import training_device
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed
from megatron_armor.models.hf_config import load_model_shape
from megatron_armor.models.tiny import make_tiny_checkpoint
from megatron_armor.scoring.batch import build_sequence_batch
from megatron_armor.scoring.logprobs import ScoringConfig, forward_backward
from megatron_armor.scoring.micro_batches import MicroBatching, round_up


def rlvr_batch(count: int, max_len: int, vocab: int, seed: int):
    """`count` samples with 32-128-token prompts and Pareto-tailed responses capped at `max_len` tokens in all."""
    rng = random.Random(seed)
    samples = []
    for index in range(count):
        prompt = rng.randint(32, 128)
        response = max(1, min(max_len - prompt, int(rng.paretovariate(1.3) * max_len / 16)))
        ids = [rng.randrange(1, vocab) for _ in range(prompt + response)]
        samples.append(Sample(index, ids[:prompt], ids[prompt:], [-1.0] * response, "stop", False, 1.0, True))
    advantages = [rng.gauss(0.0, 1.0) for _ in samples]
    return build_sequence_batch(samples, advantages, pad_token_id=0)


def layouts(args, longest: int) -> dict[str, MicroBatching]:
    return {
        "padded": MicroBatching(MicroBatchingConfig(args.micro_batch_size), pad_to_multiple_of=round_up(longest, 8)),
        "fixed": MicroBatching(MicroBatchingConfig(args.micro_batch_size)),
        "budget": MicroBatching(MicroBatchingConfig(max_tokens=args.max_tokens)),
        "packed": MicroBatching(MicroBatchingConfig(max_tokens=args.max_tokens, pack=True)),
    }


def step_seconds(model, micro_batches, repeats: int) -> float:
    """Median seconds of a forward + backward of a policy-gradient loss over `micro_batches`."""
    def loss_fn(scores, rows):
        loss = -(scores.logprobs * rows.per_token_advantages() * rows.response_mask).sum()
        return loss, rows.response_mask.sum().to(torch.int), {}

    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        model.zero_grad()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        forward_backward(model, micro_batches, loss_fn, scoring=ScoringConfig(), forward_only=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=64, help="rows of the rank's batch")
    parser.add_argument("--max-len", type=int, default=1024, help="longest prompt + response")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="rows per micro-batch (padded, fixed)")
    parser.add_argument("--max-tokens", type=int, default=4096, help="token budget of a micro-batch")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    initialize_distributed(1, 1, 1)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_tiny_checkpoint(tmp, hidden_size=args.hidden, num_layers=args.layers,
                                          intermediate_size=4 * args.hidden, num_attention_heads=max(4, args.hidden // 64),
                                          num_key_value_heads=2, max_position_embeddings=args.max_len, vocab_size=512)
        model = load_gpt_model(checkpoint, load_model_shape(checkpoint), trainable=True)
    batch = rlvr_batch(args.sequences, args.max_len, 512, seed=0)
    lengths = batch.real_lengths().tolist()
    real = sum(lengths)
    print(f"{args.sequences} sequences on {training_device()}: {real} real tokens, mean {real / len(lengths):.0f}, "
          f"longest {max(lengths)}; model hidden {args.hidden} x {args.layers} layers")
    print(f"{'layout':>8} {'micro-batches':>13} {'computed/real':>13} {'seconds':>9} {'time ratio':>10}")
    baseline = None
    for name, batching in layouts(args, max(lengths)).items():
        micro_batches = batching.split(batch)
        computed = sum(batching.computed_tokens([lengths[r] for r in mb.row_index.tolist()]) for mb in micro_batches)
        seconds = step_seconds(model, micro_batches, args.repeats)
        baseline = baseline or seconds
        print(f"{name:>8} {len(micro_batches):>13} {computed / real:>13.2f} {seconds:>9.3f} {seconds / baseline:>10.2f}")
    destroy_distributed()


if __name__ == "__main__":
    main()
