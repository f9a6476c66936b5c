"""A LoRA adapter's files in Hugging Face PEFT's format: `adapter_config.json` (PEFT's config dict) and
`adapter_model.safetensors` (PEFT-named tensors, `base_model.model.<layer>.lora_A.weight` `[r, in]`,
`.lora_B.weight` `[out, r]`): what `peft.PeftModel.from_pretrained` and SGLang's /load_lora_adapter read."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # PeftModel's prefix of the wrapped HF model's names


def write_peft_adapter(tensors: dict[str, torch.Tensor], config: dict, out_dir: str | Path) -> Path:
    """Write PEFT-named `tensors` and PEFT's `config` dict to `out_dir` (made if missing); returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({key: value.contiguous() for key, value in tensors.items()}, str(out / ADAPTER_WEIGHTS))
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return out


def read_peft_adapter(adapter_dir: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(PEFT's config dict, the PEFT-named tensors on the CPU) of the adapter directory `adapter_dir`."""
    adapter = Path(adapter_dir)
    return json.loads((adapter / ADAPTER_CONFIG).read_text()), load_file(str(adapter / ADAPTER_WEIGHTS))
