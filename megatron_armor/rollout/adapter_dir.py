"""`AdapterDir`: LoRA adapter pushes by path (model.lora.push_dir), for servers that cannot open the trainer's
shared-memory handles (on other hosts) but read a filesystem it writes to.

Each push writes the adapter in PEFT's format (`utils.peft_files`) to a new version directory
`<root>/<prefix>-v<N>/`, first under a hidden temporary name in `root`, then renamed into place (a rename within one
directory is atomic: a server never sees half an adapter), and removes the versions older than the newest `keep`. The
versions go on from the highest found in `root`, so a resumed run never writes over a directory a server may still
name.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

import torch

from megatron_armor.utils.peft_files import write_peft_adapter


class AdapterDir:
    """Versioned PEFT directories of one adapter under `root` (made if missing), named `<prefix>-v<N>`; the newest
    `keep` stay."""

    def __init__(self, root: str | Path, prefix: str, *, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"AdapterDir keeps at least the newest version, got keep={keep}")
        self.root, self.prefix, self.keep = Path(root), prefix, keep
        self.root.mkdir(parents=True, exist_ok=True)
        self._pattern = re.compile(rf"{re.escape(prefix)}-v(\d+)")
        self.version = max(self._versions(), default=0)

    def write(self, tensors: dict[str, torch.Tensor], config: dict) -> Path:
        """The adapter `tensors` (PEFT-named) with PEFT's `config` dict as the next version's directory, whole once
        it appears; returns its path. Older versions beyond the newest `keep` are removed."""
        final = self.root / f"{self.prefix}-v{self.version + 1:06d}"
        staging = self.root / f".{final.name}.{uuid.uuid4().hex}.tmp"
        try:
            write_peft_adapter(tensors, config, staging)
            os.rename(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self.version += 1
        for old in sorted(self._versions())[:-self.keep]:
            shutil.rmtree(self.root / f"{self.prefix}-v{old:06d}", ignore_errors=True)
        return final

    def _versions(self) -> list[int]:
        """The version numbers of this adapter's directories in `root`."""
        return [int(match.group(1)) for entry in self.root.iterdir()
                if entry.is_dir() and (match := self._pattern.fullmatch(entry.name))]
