"""Rollout throughput: the in-process engine (batched, KV-cached) against an uncached baseline.

Both paths generate the same number of tokens per prompt from the same model (greedy, stop tokens
off, so every row produces exactly `--new-tokens` tokens): (a) `LocalEngine.generate`, one batched
call with a KV cache; (b) the baseline, which recomputes the whole prefix for every new token, one
prompt at a time, as a naive sampler would. Optionally (c) the same engine behind the SGLang-schema
HTTP server (`--http`), to show the protocol overhead. Ratios are against (b), measured in this run.

    python benchmarks/bench_rollout.py                      # small CPU model
    python benchmarks/bench_rollout.py --hidden 512 --layers 8 --prompts 32 --new-tokens 64 --http
    python benchmarks/bench_rollout.py --vs-hf              # against transformers' generate (issue 18)
    python benchmarks/bench_rollout.py --vs-hf --device cuda --dtype bfloat16   # the same on a GPU

`--vs-hf` instead times HF `model.generate` against `LocalEngine.generate` on the same model, prompts,
sampling (T = 1, seeded) and threads, alternating the two `--repeats` times (median and spread of each side's
tokens/s, and the machine's load around each case), for three cases: (a) a tiny
model with short EOS-terminated responses, (b) 8 layers x 512 hidden x 32k vocabulary, 128-token
prompts, 64 new tokens ((b') the same with RL's layout, 2 prompts x 8 samples each: the engine prefills a shared
prompt once), (c) the model of (b) with long-tailed lengths (most rows stop after a few
tokens, an eighth run to the limit). Tokens/s counts the response tokens each side produced. The engine also runs
with `prepack_weights=False` (its linear layers on `F.linear`, as HF's are) to show what the oneDNN weight layout adds.
"""

from __future__ import annotations

import argparse
import os
import statistics
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
    """(seconds, result) of `fn()`; on a GPU the seconds include the work it queued."""
    _synchronize()
    start = time.perf_counter()
    result = fn()
    _synchronize()
    return time.perf_counter() - start, result


def _synchronize() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


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


def _hf_generate(model, prompts: list[list[int]], sampling: SamplingParams) -> int:
    """transformers' own sampler on the left-padded batch; returns the response tokens it produced
    (up to and including the first stop token of each row)."""
    width, device = max(len(p) for p in prompts), model.device
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    torch.manual_seed(sampling.seed or 0)
    draw = dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
    out = model.generate(input_ids=ids, attention_mask=mask, **(draw if sampling.temperature > 0 else {"do_sample": False}),
                         max_new_tokens=sampling.max_new_tokens, pad_token_id=0,
                         eos_token_id=list(sampling.stop_token_ids) or None)[:, width:]
    stop = torch.isin(out, torch.tensor(list(sampling.stop_token_ids) or [-1], device=device))
    after_stop = (stop.cumsum(-1) - stop.long()) > 0  # positions after each row's first stop token
    return int((~after_stop).sum())


def _vs_hf_case(name: str, path: Path, prompts, sampling: SamplingParams, repeats: int, **placement) -> None:
    """Alternate HF generate, the engine on `F.linear` (`prepack_weights=False`) and the engine `repeats` times, each
    on its own copy of the checkpoint at `path` (on `placement`'s device and dtype); print each side's tokens/s as the
    median [min-max] over the repeats (tokens/s, as the sides may stop rows after different token counts: each run's
    response tokens over its seconds), the engine's ratios of medians, and the machine's 1-minute load average before
    and after the case (other processes on the machine slow both sides alike only when the load stays flat)."""
    load_before = os.getloadavg()[0]
    hf_model = _load(path, **placement)
    engines = {"unpacked": LocalEngine(_load(path, **placement), prepack_weights=False),
               "engine": LocalEngine(_load(path, **placement))}
    rates: dict[str, list[float]] = {"hf": [], "unpacked": [], "engine": []}
    tokens = {}
    for _ in range(repeats):
        t, tokens["hf"] = timed(lambda: _hf_generate(hf_model, prompts, sampling))
        rates["hf"].append(tokens["hf"] / t)
        for side, engine in engines.items():
            t, generations = timed(lambda: engine.generate(prompts, sampling))
            tokens[side] = sum(len(g.response_ids) for g in generations)
            rates[side].append(tokens[side] / t)
    median = {side: statistics.median(values) for side, values in rates.items()}
    spread = {side: f"{median[side]:.1f} [{min(values):.1f}-{max(values):.1f}]" for side, values in rates.items()}
    print(f"{name:>34} {tokens['hf']:>7} {spread['hf']:>24} {spread['unpacked']:>24} {tokens['engine']:>7} "
          f"{spread['engine']:>24} {median['engine'] / median['hf']:>6.2f}x {median['engine'] / median['unpacked']:>9.2f}x"
          f"  load {load_before:.1f} -> {os.getloadavg()[0]:.1f}")


def _load(path: Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def vs_hf(repeats: int, device: str, dtype: torch.dtype) -> None:
    """Cases (a)-(c) of issue 18 (see the module docstring), every model on `device` in `dtype`."""
    g = torch.Generator().manual_seed(0)
    placement = {"device": device, "dtype": dtype}
    where = torch.cuda.get_device_name(device) if device.startswith("cuda") else f"{torch.get_num_threads()} threads"
    print(f"{where}, {dtype}; median [min-max] of {repeats} alternating runs; T = 1, top-p 1; "
          f"{os.cpu_count()} CPUs, their 1-minute load average around each case")
    print(f"{'case':>34} {'hf tok':>7} {'hf tok/s':>24} {'F.linear tok/s':>24} {'eng tok':>7} {'eng tok/s':>24} "
          f"{'vs hf':>7} {'vs F.lin':>10}")
    print("(F.linear: the engine with prepack_weights=False; eng: the engine as it runs by default; ratios of medians)")
    with tempfile.TemporaryDirectory() as tmp:
        tiny = make_tiny_checkpoint(Path(tmp) / "tiny", seed=0)  # 2 layers x 64 hidden, 128-token vocabulary
        prompts = [torch.randint(1, 96, (int(n),), generator=g).tolist() for n in torch.randint(4, 17, (32,), generator=g)]
        _vs_hf_case("(a) tiny, 32 prompts, EOS-terminated", tiny, prompts,
                    SamplingParams(temperature=1.0, max_new_tokens=32, seed=0, stop_token_ids=[2, 3, 4, 5]), repeats,
                    **placement)
        big = make_tiny_checkpoint(Path(tmp) / "big", seed=0, hidden_size=512, num_layers=8, num_attention_heads=8,
                                   num_key_value_heads=4, intermediate_size=1536, vocab_size=32000,
                                   max_position_embeddings=512)
        prompts = [torch.randint(1, 96, (128,), generator=g).tolist() for _ in range(16)]
        _vs_hf_case("(b) 8x512, 32k vocab, 16x128 -> 64", big, prompts,
                    SamplingParams(temperature=1.0, max_new_tokens=64, seed=0), repeats, **placement)
        # (b) in RL's layout: 2 prompts x 8 samples each (TRL's GRPOTrainer also hands `generate` each prompt
        # repeated num_generations times); the engine prefills each prompt once, HF's generate every row
        rl_prompts = [prompt for prompt in prompts[:2] for _ in range(8)]
        _vs_hf_case("(b') as (b), 2 prompts x 8 samples", big, rl_prompts,
                    SamplingParams(temperature=1.0, max_new_tokens=64, seed=0), repeats, **placement)
        # (c), greedy so both sides decode the same rows: stop tokens are tokens that rows 2.. draw within
        # their first 6 and rows 0-1 never draw, so 14 rows stop within 6 tokens and 2 run to the limit.
        greedy = SamplingParams(temperature=0.0, max_new_tokens=64)
        drawn = [g.response_ids for g in LocalEngine(_load(big, **placement)).generate(prompts, greedy)]
        stops = sorted({t for ids in drawn[2:] for t in ids[:6]} - {t for ids in drawn[:2] for t in ids})
        _vs_hf_case("(c) as (b) greedy, 14 rows stop <= 6", big, prompts,
                    SamplingParams(temperature=0.0, max_new_tokens=64, stop_token_ids=stops), repeats, **placement)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--http", action="store_true", help="also time the SGLang-schema HTTP path")
    parser.add_argument("--vs-hf", action="store_true", help="time HF generate against the engine (cases a-c)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="--vs-hf: where the models run (cpu, cuda)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="--vs-hf: model dtype")
    args = parser.parse_args()
    if args.vs_hf:
        vs_hf(args.repeats, args.device, getattr(torch, args.dtype))
        return

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_checkpoint(
            Path(tmp) / "model", hidden_size=args.hidden, num_layers=args.layers, num_attention_heads=8,
            num_key_value_heads=4, intermediate_size=args.hidden * 3, max_position_embeddings=1024, seed=0,
        )
        model = _load(model_dir)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, 96, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
        sampling = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)
        tokens = args.prompts * args.new_tokens

        engine = LocalEngine(_load(model_dir))  # its own copy: the engine replaces its model's linear layers
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
