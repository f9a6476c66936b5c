"""Tiny HF checkpoints of every registered model family (`models.families`) with a character-level tokenizer, made
locally.

The tokenizer has one token per printable ASCII character, newline and tab, plus `<|endoftext|>`
(EOS and padding): 98 tokens. Any other character (e.g. carriage return) encodes as EOS. The
model's vocabulary is padded to `vocab_size` (default 128, a multiple of 128 so it divides any
tensor-parallel size); the extra rows are simply never produced by the tokenizer.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from megatron_armor.models.families import MoEFamily, model_family

EOS_TOKEN = "<|endoftext|>"
# The 95 printable ASCII characters (ids 1..95), then newline and tab (96, 97): earlier ids unchanged.
_CHARACTERS = [c for c in string.printable if c.isprintable()] + ["\n", "\t"]
# Router weights of tiny MoE models are drawn with this std (HF's 0.02 makes near-ties among the experts'
# scores common; a rounding difference between two implementations would then route a token differently).
TINY_ROUTER_STD = 0.5
# A sigmoid router's expert-bias correction term (GLM-4.5's e_score_correction_bias, zeros in a fresh transformers
# model) is drawn with this std, so the bias changes which experts are chosen and a mapping that lost it would show.
TINY_EXPERT_BIAS_STD = 0.1


def make_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer, lossless on `_CHARACTERS` (no BOS, no normalisation, no inserted spaces)."""
    vocab = {EOS_TOKEN: 0, **{c: i + 1 for i, c in enumerate(_CHARACTERS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=EOS_TOKEN))
    # One piece per character; `[\s\S]`, unlike `.`, also matches a newline.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern=Regex(r"[\s\S]"), behavior="isolated")
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
    head_dim: int | None = None,
    rope_scaling_factor: float | None = None,
    seed: int = 0,
    moe: dict | None = None,
) -> Path:
    """Write config.json, model.safetensors, tokenizer and generation config to `out_dir`.

    `arch`: a registered model_type. `rope_scaling_factor` adds Llama 3 RoPE scaling (llama only); `head_dim`
    defaults to hidden_size / num_attention_heads. The family's `tiny_fields` complete the config, or override its
    fields (a MoE family's experts: `models.families.moe.TINY_EXPERTS`; DeepSeek-V3's attention ranks, key/value heads
    and YaRN RoPE); `moe` (MoE families only) overrides them.
    """
    family = model_family(arch, source="make_tiny_checkpoint")
    if moe and not isinstance(family, MoEFamily):
        raise ValueError(f"moe={moe} given for {arch}, which has no experts")
    tokenizer = make_char_tokenizer()
    if len(tokenizer) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    config = getattr(transformers, family.config_class)(**{
        "vocab_size": vocab_size, "hidden_size": hidden_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_attention_heads, "num_key_value_heads": num_key_value_heads,
        "intermediate_size": intermediate_size, "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6, "rope_parameters": _rope_parameters(rope_theta, rope_scaling_factor),
        "head_dim": head_dim or hidden_size // num_attention_heads,
        "tie_word_embeddings": tie_word_embeddings, "attention_dropout": 0.0,
        "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None,
        **family.tiny_fields, **(moe or {}),
    })
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _widen_routers(model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _widen_routers(model: torch.nn.Module) -> None:
    """Redraw every MoE router weight `[experts, hidden]` with std `TINY_ROUTER_STD`, then every expert-bias buffer
    `[experts]` with std `TINY_EXPERT_BIAS_STD` (no-op for dense models)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, TINY_ROUTER_STD)
        for name, buffer in model.named_buffers():
            if name.endswith("mlp.gate.e_score_correction_bias"):
                buffer.normal_(0.0, TINY_EXPERT_BIAS_STD)


def _rope_parameters(theta: float, scaling_factor: float | None) -> dict:
    if scaling_factor is None:
        return {"rope_type": "default", "rope_theta": theta}
    return {"rope_type": "llama3", "rope_theta": theta, "factor": scaling_factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
