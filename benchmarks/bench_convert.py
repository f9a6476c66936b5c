"""Checkpoint conversion throughput and peak memory against plain safetensors loading, same files, same run.

Makes a random Qwen3-architecture HF checkpoint locally (default: hidden 1024, 8 layers, vocab 32000,
~160M parameters, fp32 ~0.65 GB), then times, each in a fresh process tree:

    import only            python + torch + megatron-core imports (the floor every conversion process pays)
    safetensors load_file  the whole state dict into memory (the plain way to read the files)
    hf->megatron tpN ppM   `armor convert hf-to-megatron` (N x M rank processes under torchrun)
    megatron->hf pp1       `armor convert megatron-to-hf` (one process)
    megatron->hf ppK       `armor convert megatron-to-hf --pp K` (K processes, one pipeline stage each)

and prints wall time, throughput (checkpoint GB / wall s, start-up included) and the peak RSS of the
largest single process of each tree (`ru_maxrss` of waited-for descendants), with ratios to load_file.

    python benchmarks/bench_convert.py                       # defaults above
    python benchmarks/bench_convert.py --hidden 2048 --layers 16 --tp 2 --pp 2 --export-pp 4
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GB = 1024**3


def measure(command: list[str]) -> dict:
    """Run `command` in a child wrapper process; wall seconds and the largest process's peak RSS (bytes)."""
    wrapper = [sys.executable, __file__, "--measure", "--", *command]
    done = subprocess.run(wrapper, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _measure_here(command: list[str]) -> None:
    """--measure: run `command`, print {"wall_s", "peak_rss"} of it (ru_maxrss of children is in KiB)."""
    start = time.perf_counter()
    rc = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    if rc.returncode != 0:
        sys.stderr.write(rc.stderr[-4000:])
        sys.exit(rc.returncode)
    print(json.dumps({"wall_s": wall, "peak_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))


def make_checkpoint(out: Path, args: argparse.Namespace) -> int:
    """Write the random HF checkpoint; returns its tensor bytes."""
    from megatron_armor.models.tiny import make_tiny_checkpoint

    make_tiny_checkpoint(
        out, arch="qwen3", hidden_size=args.hidden, num_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256), head_dim=64, intermediate_size=3 * args.hidden,
        vocab_size=args.vocab, max_position_embeddings=4096,
    )
    return sum(p.stat().st_size for p in out.glob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tp", type=int, default=2, help="layout of the second hf->megatron run (the first is tp1 pp1)")
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--export-pp", type=int, default=2, help="processes of the second megatron->hf run")
    parser.add_argument("--work-dir", help="where the checkpoints go (default: a temporary directory)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        work = Path(work)
        hf_dir = work / "hf"
        size = make_checkpoint(hf_dir, args)
        files = sorted(str(p) for p in hf_dir.glob("*.safetensors"))
        convert = [sys.executable, "-m", "megatron_armor.convert.cli"]
        runs = {
            "import only": [sys.executable, "-c", "import megatron_armor.convert.hf_to_megatron"],
            "safetensors load_file": [
                sys.executable, "-c",
                f"from safetensors.torch import load_file; state = [load_file(f) for f in {files!r}]",
            ],
            "hf->megatron tp1 pp1": [*convert, "hf-to-megatron", "--hf-path", str(hf_dir), "--out", str(work / "m1")],
            f"hf->megatron tp{args.tp} pp{args.pp}": [
                *convert, "hf-to-megatron", "--hf-path", str(hf_dir), "--out", str(work / "m2"),
                "--tp", str(args.tp), "--pp", str(args.pp),
            ],
            "megatron->hf pp1": [*convert, "megatron-to-hf", "--megatron-path", str(work / "m2"), "--out", str(work / "hf2")],
            f"megatron->hf pp{args.export_pp}": [
                *convert, "megatron-to-hf", "--megatron-path", str(work / "m2"), "--out", str(work / "hf3"),
                "--pp", str(args.export_pp),
            ],
        }
        results = {name: measure(command) for name, command in runs.items()}

    base = results["safetensors load_file"]
    print(f"checkpoint: qwen3 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: {size / GB:.3f} GB "
          f"in {len(files)} safetensors file(s)")
    print(f"{'run':<24}{'wall s':>8}{'GB/s':>8}{'peak RSS GB':>13}{'x load_file':>13}{'time x':>8}")
    for name, r in results.items():
        throughput = "-" if name == "import only" else f"{size / GB / r['wall_s']:.3f}"
        print(f"{name:<24}{r['wall_s']:>8.2f}{throughput:>8}{r['peak_rss'] / GB:>13.3f}"
              f"{r['peak_rss'] / base['peak_rss']:>13.2f}{r['wall_s'] / base['wall_s']:>8.2f}")
    print("peak RSS = largest single process of the run; 'import only' (python + torch + megatron-core) is the "
          "floor every conversion process pays; both directions stream one parameter at a time, so a process holds "
          "about the floor plus its largest parameter (and the HF tensors it splits into).")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--measure"]:
        _measure_here(sys.argv[3:])
    else:
        main()
