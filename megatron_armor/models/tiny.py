"""Tiny Llama/Qwen2/Qwen3/Qwen2-MoE/Qwen3-MoE-architecture HF checkpoints with a character-level tokenizer, made
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
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2MoeConfig, Qwen3Config,
    Qwen3MoeConfig,
)

EOS_TOKEN = "<|endoftext|>"
# The 95 printable ASCII characters (ids 1..95), then newline and tab (96, 97): earlier ids unchanged.
_CHARACTERS = [c for c in string.printable if c.isprintable()] + ["\n", "\t"]
_CONFIGS = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig, "qwen2_moe": Qwen2MoeConfig,
            "qwen3_moe": Qwen3MoeConfig}
# MoE defaults of a tiny model (override with `moe=`): 4 experts of width 32, top-2, every layer MoE, no auxiliary
# loss; Qwen3-MoE renormalises the top-2 probabilities, Qwen2-MoE (as its releases) does not and adds a gated
# shared expert of width 48.
_TINY_EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
                 "mlp_only_layers": [], "router_aux_loss_coef": 0.0}
TINY_MOE = {
    "qwen3_moe": {**_TINY_EXPERTS, "norm_topk_prob": True},
    "qwen2_moe": {**_TINY_EXPERTS, "norm_topk_prob": False, "shared_expert_intermediate_size": 48},
}
# Router weights of tiny MoE models are drawn with this std (HF's 0.02 makes near-ties among the experts'
# scores common; a rounding difference between two implementations would then route a token differently).
TINY_ROUTER_STD = 0.5


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

    `rope_scaling_factor` adds Llama 3 RoPE scaling (llama only); `head_dim` defaults to
    hidden_size / num_attention_heads. `moe` (MoE archs only): config fields over the arch's `TINY_MOE`.
    """
    if arch not in _CONFIGS:
        raise ValueError(f"arch must be one of {sorted(_CONFIGS)}, got {arch!r}")
    tokenizer = make_char_tokenizer()
    if len(tokenizer) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    config = _CONFIGS[arch](
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6, rope_parameters=_rope_parameters(rope_theta, rope_scaling_factor),
        head_dim=head_dim or hidden_size // num_attention_heads,
        tie_word_embeddings=tie_word_embeddings, attention_dropout=0.0,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        **({**TINY_MOE[arch], **(moe or {})} if arch in TINY_MOE else {}),
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _widen_routers(model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _widen_routers(model: torch.nn.Module) -> None:
    """Redraw every MoE router weight `[experts, hidden]` with std `TINY_ROUTER_STD` (no-op for dense models)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, TINY_ROUTER_STD)


def _rope_parameters(theta: float, scaling_factor: float | None) -> dict:
    if scaling_factor is None:
        return {"rope_type": "default", "rope_theta": theta}
    return {"rope_type": "llama3", "rope_theta": theta, "factor": scaling_factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
