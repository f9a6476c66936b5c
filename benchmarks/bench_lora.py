"""Full fine-tuning vs LoRA (rank 8 and 64) on one model, in one run: per-rank memory, weight-sync bytes, step time.

On a Qwen2-shaped model built here (default hidden 256, 4 layers, FFN 704, 4 heads / 2 KV heads, vocabulary 512:
3.2M parameters; one process), for each variant it measures
- the trainer's state in bytes, exact: parameters (the base, and the adapters under LoRA), gradients (Megatron DDP's
  fp32 grad buffers: the trained parameters only) and Adam's state (moments and step counts after one step);
- the activations saved for backward by one micro-batch's forward and logprobs (the storages that
  `torch.autograd.graph.saved_tensors_hooks` sees, each counted once, parameters left out);
- the bytes of one weight sync: every HF weight (full; under LoRA merged, W + (alpha / r) B A, what the engines get
  today) and the adapters alone (their PEFT tensors, `convert.peft_export.peft_tensors`: what an engine that applies
  the adapter on the base it loaded once would get);
- the median time of a training step on a fixed batch (forward + backward of a policy-gradient loss over its
  micro-batches, then the optimizer step),
and prints each against full fine-tuning's of the same run. LoRA targets every projection (qkv, proj, fc1, fc2),
alpha = 2 r.

With --accuracy it also trains the demo (examples/tiny/armor.yaml, one process, 100 RL steps; its cached
warm-started checkpoint under --cache-dir, made on first use) with full fine-tuning at the demo's lr and with rank-8
LoRA at --lora-lr-scale times it, once per --seeds, and prints the validation accuracy before and after: minutes
on a CPU.

    OMP_NUM_THREADS=1 python benchmarks/bench_lora.py
    OMP_NUM_THREADS=1 python benchmarks/bench_lora.py --hidden 512 --layers 8 --tokens 512
    OMP_NUM_THREADS=1 python benchmarks/bench_lora.py --accuracy
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_armor.config import LoRAConfig, MicroBatchingConfig, OptimizerConfig, load_config
from megatron_armor.convert.loading import load_gpt_model
from megatron_armor.convert.peft_export import peft_tensors
from megatron_armor.convert.weights import gather_hf_weights
from megatron_armor.data.types import Sample
from megatron_armor.distributed.cpu_compat import megatron_device_scope
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed
from megatron_armor.models.hf_config import ModelShape, load_model_shape
from megatron_armor.models.lora import apply_lora
from megatron_armor.models.tiny import make_tiny_checkpoint
from megatron_armor.scoring.batch import SequenceBatch, build_sequence_batch
from megatron_armor.scoring.logprobs import ScoringConfig, forward_backward, token_logprobs
from megatron_armor.scoring.micro_batches import MicroBatching
from megatron_armor.trainer.update.optimizer import optimizer_step, torch_optimizers, wrap_for_training

RANKS = (0, 8, 64)  # 0: full fine-tuning
DEMO = Path(__file__).parents[1] / "examples" / "tiny" / "armor.yaml"


@dataclass(frozen=True)
class Figures:
    """One variant's measurements (bytes per rank, seconds)."""

    params: int
    trained_params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    sync_full_bytes: int
    sync_adapter_bytes: int
    step_seconds: float

    @property
    def state_bytes(self) -> int:
        """Parameters, gradients and optimizer state together."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def nbytes(tensors) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def random_batch(sequences: int, tokens: int, vocab: int, seed: int) -> SequenceBatch:
    """`sequences` samples of `tokens` tokens each (a quarter prompt), random ids and advantages."""
    rng = random.Random(seed)
    prompt = tokens // 4
    samples = [Sample(index, [rng.randrange(1, vocab) for _ in range(prompt)],
                      [rng.randrange(1, vocab) for _ in range(tokens - prompt)], [-1.0] * (tokens - prompt), "stop",
                      False, 1.0, True) for index in range(sequences)]
    return build_sequence_batch(samples, [rng.gauss(0.0, 1.0) for _ in samples], pad_token_id=0)


def policy_loss(scores, rows):
    """A policy-gradient loss over the response tokens (what the step's backward costs, not ARMOR's exact loss)."""
    loss = -(scores.logprobs * rows.per_token_advantages() * rows.response_mask).sum()
    return loss, rows.response_mask.sum().to(torch.int), {}


def saved_activation_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter storages autograd saves for backward in a forward of `model` and the token
    logprobs of `tokens` [b, S]."""
    params = {param.untyped_storage().data_ptr() for param in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with megatron_device_scope(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logprobs = token_logprobs(model(tokens, positions, None), tokens)
    del logprobs
    return sum(saved.values())


def measure(checkpoint: Path, shape: ModelShape, rank: int, batch: SequenceBatch, args) -> Figures:
    """The figures of full fine-tuning (`rank` 0) or rank-`rank` LoRA on `checkpoint`."""
    model = load_gpt_model(checkpoint, shape, trainable=True)
    if rank:
        apply_lora(model, LoRAConfig(rank=rank, alpha=2.0 * rank), seed=0)
    ddp, optimizer = wrap_for_training(OptimizerConfig(lr=1e-5, warmup_steps=0), model=model)
    micro_batches = MicroBatching(MicroBatchingConfig(args.micro_batch_size)).split(batch)
    times = []
    for _ in range(args.repeats + 1):  # the first, a warm-up, also creates Adam's state
        start = time.perf_counter()
        forward_backward(ddp, micro_batches, policy_loss, scoring=ScoringConfig(), forward_only=False)
        optimizer_step(ddp, optimizer, lr=1e-5)
        times.append(time.perf_counter() - start)
    trained = [param for param in model.parameters() if param.requires_grad]
    state = [value for inner in torch_optimizers(optimizer) for param_state in inner.state.values()
             for value in param_state.values() if torch.is_tensor(value)]
    tokens = micro_batches[0].model_tokens[0]
    with torch.no_grad():
        full_sync = nbytes(tensor for _, tensor in gather_hf_weights(model, shape))
    return Figures(
        params=sum(param.numel() for param in model.parameters()), trained_params=sum(p.numel() for p in trained),
        param_bytes=nbytes(model.parameters()), grad_bytes=nbytes(buffer.grad_data for buffer in ddp.buffers),
        optimizer_bytes=nbytes(state), activation_bytes=saved_activation_bytes(model, tokens),
        sync_full_bytes=full_sync,
        sync_adapter_bytes=nbytes(peft_tensors(model, shape).values()) if rank else full_sync,
        step_seconds=sorted(times[1:])[len(times[1:]) // 2],
    )


def print_table(results: dict[int, Figures]) -> None:
    full = results[0]
    mib = lambda value: f"{value / 2**20:9.3f}"  # noqa: E731
    print(f"{'variant':>9} {'params':>9} {'trained':>9} | MiB: {'params':>9} {'grads':>9} {'Adam':>9} {'state':>9} "
          f"{'saved act':>9} | sync MiB: {'merged':>9} {'adapters':>9} | {'step s':>7}")
    for rank, fig in results.items():
        name = "full" if rank == 0 else f"LoRA r{rank}"
        print(f"{name:>9} {fig.params:>9} {fig.trained_params:>9} |      {mib(fig.param_bytes)} {mib(fig.grad_bytes)} "
              f"{mib(fig.optimizer_bytes)} {mib(fig.state_bytes)} {mib(fig.activation_bytes)} |           "
              f"{mib(fig.sync_full_bytes)} {mib(fig.sync_adapter_bytes)} | {fig.step_seconds:7.3f}")
    print("ratios to full fine-tuning (same run):")
    for rank, fig in results.items():
        if rank:
            print(f"  LoRA r{rank}: trained params {fig.trained_params / full.trained_params:.4f}, grads "
                  f"{fig.grad_bytes / full.grad_bytes:.4f}, Adam {fig.optimizer_bytes / full.optimizer_bytes:.4f}, "
                  f"params+grads+Adam {fig.state_bytes / full.state_bytes:.3f}, saved activations "
                  f"{fig.activation_bytes / full.activation_bytes:.3f}, sync merged "
                  f"{fig.sync_full_bytes / full.sync_full_bytes:.3f}, sync adapters only "
                  f"{fig.sync_adapter_bytes / full.sync_full_bytes:.4f}, step time "
                  f"{fig.step_seconds / full.step_seconds:.2f}")


def demo_accuracy(cache_dir: Path, lr_scale: float, seeds: list[int]) -> dict[tuple[str, int], dict[int, float]]:
    """val/accuracy before and after 100 RL steps of the demo, one process, for each run seed (`train.seed`): full
    fine-tuning at the demo's lr, and rank-8 LoRA at `lr_scale` times it. Keys: (variant, seed)."""
    from megatron_armor.trainer.run.train import run_training

    demo_lr = load_config(str(DEMO)).optimizer.lr
    variants = {"full": [], "lora-r8": ["model.lora.rank=8", f"optimizer.lr={demo_lr * lr_scale}"]}
    accuracy = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for name, overrides in variants.items():
                run_dir = Path(tmp) / f"{name}-{seed}"
                cfg = load_config(str(DEMO), [
                    "parallel.tensor_parallel_size=1", f"task.cache_dir={cache_dir}", f"logging.run_dir={run_dir}",
                    f"train.seed={seed}", "eval.every=100", "checkpoint.every=100", "checkpoint.keep_last=1",
                    "checkpoint.save_model=false", "logging.tensorboard=false", "logging.plot=false",
                    "logging.progress_bar=false", *overrides])
                start = time.perf_counter()
                assert run_training(cfg) == 0, name
                rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
                accuracy[name, seed] = {row["step"]: row["val/accuracy"] for row in rows if "val/accuracy" in row}
                print(f"demo, {name} (lr {cfg.optimizer.lr:g}, seed {seed}): val/accuracy {accuracy[name, seed]} "
                      f"({time.perf_counter() - start:.0f} s)", flush=True)
    for name in variants:
        after = [accuracy[name, seed][max(accuracy[name, seed])] for seed in seeds]
        print(f"demo, {name}: val/accuracy after 100 steps, mean over seeds {seeds}: {sum(after) / len(after):.3f} "
              f"[{min(after):.3f}-{max(after):.3f}]")
    return accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--sequences", type=int, default=8, help="sequences in the step's batch")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--accuracy", action="store_true", help="also train the demo 100 steps, full vs LoRA")
    parser.add_argument("--cache-dir", type=Path, default=Path(".cache/megatron-armor"), help="the demo's task cache")
    parser.add_argument("--lora-lr-scale", type=float, default=10.0, help="LoRA's lr over full fine-tuning's")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2], help="--accuracy: the runs' train.seed")
    args = parser.parse_args()

    initialize_distributed(1, 1, 1)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_tiny_checkpoint(
            tmp, hidden_size=args.hidden, num_layers=args.layers, num_attention_heads=max(2, args.hidden // 64),
            num_key_value_heads=max(1, args.hidden // 128), intermediate_size=args.hidden * 11 // 4,
            max_position_embeddings=max(256, args.tokens), vocab_size=512)
        shape = load_model_shape(checkpoint)
        batch = random_batch(args.sequences, args.tokens, shape.vocab_size, seed=0)
        print(f"model: {shape.arch}, hidden {shape.hidden_size}, {shape.num_layers} layers, ffn {shape.ffn_hidden_size}, "
              f"heads {shape.num_attention_heads} (kv {shape.num_kv_heads}), vocab {shape.vocab_size}; fp32, one "
              f"process; step: {args.sequences} x {args.tokens} tokens in micro-batches of {args.micro_batch_size}, "
              f"median of {args.repeats}")
        results = {rank: measure(checkpoint, shape, rank, batch, args) for rank in RANKS}
    print_table(results)
    destroy_distributed()
    if args.accuracy:
        demo_accuracy(args.cache_dir, args.lora_lr_scale, args.seeds)


if __name__ == "__main__":
    main()
