"""Rollout throughput: the in-process engine (batched, KV-cached) against an uncached baseline.

Both paths generate the same number of tokens per prompt from the same model (greedy, stop tokens
off, so every row produces exactly `--new-tokens` tokens): (a) `LocalEngine.generate`, one batched
call with a KV cache; (b) the baseline, which recomputes the whole prefix for every new token, one
prompt at a time, as a naive sampler would. Optionally (c) the same engine behind the SGLang-schema
HTTP server (`--http`), to show the protocol overhead. Ratios are against (b), measured in this run.

    python benchmarks/bench_rollout.py                      # small CPU model
    python benchmarks/bench_rollout.py --hidden 512 --layers 8 --prompts 32 --new-tokens 64 --http
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from megatron_armor.models.tiny import make_tiny_checkpoint
from megatron_armor.rollout.base import SamplingParams
from megatron_armor.rollout.local import LocalEngine
from megatron_armor.utils.net import free_port


@torch.no_grad()
def uncached_generate(model, prompts: list[list[int]], new_tokens: int) -> int:
    """Greedy decoding that re-runs the full sequence for every token; returns tokens generated."""
    produced = 0
    for prompt in prompts:
        ids = torch.tensor([prompt])
        for _ in range(new_tokens):
            next_id = model(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
            produced += 1
    return produced


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def http_seconds(model_dir: Path, prompts: list[list[int]], sampling: SamplingParams) -> float:
    """Time one `generate` through SGLangEngine against a `serve-local` subprocess (startup excluded)."""
    from megatron_armor.rollout.sglang_engine import SGLangEngine, SGLangEngineConfig

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "megatron_armor.rollout.http_server", "--model", str(model_dir), "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        engine = SGLangEngine([f"http://127.0.0.1:{port}"], SGLangEngineConfig(prompts_per_request=len(prompts)))
        seconds, _ = timed(lambda: engine.generate(prompts, sampling))
        return seconds
    finally:
        server.kill()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--http", action="store_true", help="also time the SGLang-schema HTTP path")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_checkpoint(
            Path(tmp) / "model", hidden_size=args.hidden, num_layers=args.layers, num_attention_heads=8,
            num_key_value_heads=4, intermediate_size=args.hidden * 3, max_position_embeddings=1024, seed=0,
        )
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, 96, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
        sampling = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)
        tokens = args.prompts * args.new_tokens

        engine = LocalEngine(model)
        engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=2))  # warm-up
        baseline_s, produced = timed(lambda: uncached_generate(model, prompts, args.new_tokens))
        engine_s, generations = timed(lambda: engine.generate(prompts, sampling))
        assert produced == tokens == sum(len(gen.response_ids) for gen in generations)

        print(f"model: hidden {args.hidden}, {args.layers} layers; {args.prompts} prompts x {args.prompt_len} tokens, "
              f"{args.new_tokens} new tokens each ({tokens} tokens), {torch.get_num_threads()} threads")
        print(f"{'path':>28} {'seconds':>9} {'tokens/s':>10} {'x baseline':>11}")
        rows = [("baseline: uncached, 1 by 1", baseline_s), ("LocalEngine: batched + KV", engine_s)]
        if args.http:
            rows.append(("SGLang schema over HTTP", http_seconds(model_dir, prompts, sampling)))
        for name, seconds in rows:
            print(f"{name:>28} {seconds:9.3f} {tokens / seconds:10.1f} {baseline_s / seconds:11.2f}")


if __name__ == "__main__":
    main()
