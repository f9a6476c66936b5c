"""Tokenizer loading that honours the class a checkpoint declares."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, TokenizersBackend


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """`AutoTokenizer`, except for checkpoints whose tokenizer_config declares the generic
    `TokenizersBackend`: transformers 5 would swap in the model type's default tokenizer class
    (e.g. Qwen2's byte-level pre-tokenizer), which breaks custom tokenizer.json files such as the
    tiny models' character-level one."""
    config_path = Path(model_dir) / "tokenizer_config.json"
    if config_path.is_file() and json.loads(config_path.read_text()).get("tokenizer_class") == "TokenizersBackend":
        return TokenizersBackend.from_pretrained(model_dir)
    return AutoTokenizer.from_pretrained(model_dir)
