"""The one way this project re-launches itself on several local ranks: `torch.distributed.run`."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def torchrun_command(nproc: int, module_args: Sequence[str], *, master_port: int | None = None) -> list[str]:
    """`python -m torch.distributed.run` running `python -m <module_args...>` on `nproc` local ranks.

    Without `master_port`, torchrun's `--standalone` rendezvous picks a free one itself.
    """
    rendezvous = [f"--master-port={master_port}"] if master_port is not None else ["--standalone"]
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous, f"--nproc-per-node={nproc}", "-m", *module_args]
