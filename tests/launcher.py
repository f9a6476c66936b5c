"""One launcher for every multi-process test: run a worker script under torchrun (gloo, CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from megatron_armor.utils.net import free_port

WORKERS = Path(__file__).parent / "workers"


def run_workers(worker: str, nproc: int, out_dir: Path, *args: str, timeout: int = 600) -> list[dict]:
    """Run `tests/workers/<worker>` on `nproc` ranks; each rank writes `out_dir/rank<r>.json`.

    Returns the per-rank results in rank order; fails with the workers' output on a non-zero exit. The
    workers' stderr (their logs) is kept in `out_dir/stderr.txt`.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
        str(WORKERS / worker), str(out_dir), *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    (out_dir / "stderr.txt").write_text(proc.stderr)
    if proc.returncode != 0:
        raise AssertionError(f"{worker} failed with exit code {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


def write_result(out_dir: str | Path, result: dict) -> None:
    """Called by a worker: store this rank's result for the test process."""
    rank = int(os.environ.get("RANK", "0"))
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
