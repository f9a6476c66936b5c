"""Tiny Llama/Qwen2-architecture HF checkpoints with a character-level tokenizer, made locally.

The tokenizer has one token per printable ASCII character plus `<|endoftext|>` (EOS and padding):
96 tokens. The model's vocabulary is padded to `vocab_size` (default 128, a multiple of 128 so it
divides any tensor-parallel size); the extra rows are simply never produced by the tokenizer.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

EOS_TOKEN = "<|endoftext|>"
_CHARACTERS = [c for c in string.printable if c.isprintable()]  # the 95 printable ASCII characters


def make_char_tokenizer() -> PreTrainedTokenizerFast:
    """A lossless character-level tokenizer (no BOS, no normalisation, no inserted spaces)."""
    vocab = {EOS_TOKEN: 0, **{c: i + 1 for i, c in enumerate(_CHARACTERS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=EOS_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern=Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)


def make_tiny_checkpoint(
    out_dir: str | Path,
    *,
    arch: str = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 176,
    max_position_embeddings: int = 256,
    vocab_size: int = 128,
    rope_theta: float = 10000.0,
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> Path:
    """Write config.json, model.safetensors, tokenizer and generation config to `out_dir`."""
    configs = {"qwen2": Qwen2Config, "llama": LlamaConfig}
    if arch not in configs:
        raise ValueError(f"arch must be one of {sorted(configs)}, got {arch!r}")
    tokenizer = make_char_tokenizer()
    if len(tokenizer) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    config = configs[arch](
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        tie_word_embeddings=tie_word_embeddings, attention_dropout=0.0,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def checkpoint_summary(model_dir: str | Path) -> dict:
    """The architecture fields of a checkpoint's config.json (for logs)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    keys = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")
    return {k: cfg.get(k) for k in keys}
