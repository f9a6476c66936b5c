#!/usr/bin/env python
"""Megatron distributed checkpoint -> HF safetensors checkpoint (same as `armor convert megatron-to-hf`).

    python tools/convert_megatron_to_hf.py --megatron-path DIR --out DIR [--pp M] [--overwrite] [--max-shard-size GB]
"""

import sys

from megatron_armor.convert.cli import main

if __name__ == "__main__":
    sys.exit(main(["megatron-to-hf", *sys.argv[1:]]))
