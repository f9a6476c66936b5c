#!/usr/bin/env python
"""Write a tiny HF checkpoint of a registered model family (config, safetensors, char tokenizer)."""

import argparse

from megatron_armor.models.families import registered_families
from megatron_armor.models.tiny import make_tiny_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--arch", choices=registered_families(), default="qwen2")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=176)
    parser.add_argument("--vocab-size", type=int, default=128, help="model vocab (>= 98 tokenizer tokens)")
    parser.add_argument("--tie-word-embeddings", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = make_tiny_checkpoint(
        args.out, arch=args.arch, hidden_size=args.hidden_size, num_layers=args.num_layers,
        num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
        intermediate_size=args.intermediate_size, vocab_size=args.vocab_size,
        tie_word_embeddings=args.tie_word_embeddings, seed=args.seed,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
