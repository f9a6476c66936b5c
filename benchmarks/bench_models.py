"""The model the weight-movement benchmarks share (bench_weight_sync.py, bench_offload.py)."""

from __future__ import annotations

from pathlib import Path

from megatron_armor.models.tiny import make_tiny_checkpoint


def qwen2_of_width(out: Path, *, hidden: int, layers: int, vocab: int) -> Path:
    """An HF Qwen2 checkpoint at `out`: 64-wide heads, one KV head per 4 query heads, FFN 11/4 x hidden
    (hidden 1024, 4 layers, vocab 32000: ~115M parameters, ~460 MB in fp32)."""
    return make_tiny_checkpoint(
        out, hidden_size=hidden, num_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256), intermediate_size=hidden * 11 // 4, vocab_size=vocab,
        max_position_embeddings=512,
    )
