#!/usr/bin/env python
"""HF safetensors checkpoint -> Megatron distributed checkpoint (same as `armor convert hf-to-megatron`).

    python tools/convert_hf_to_megatron.py --hf-path DIR --out DIR --tp N --pp M [--overwrite]
"""

import sys

from megatron_armor.convert.cli import main

if __name__ == "__main__":
    sys.exit(main(["hf-to-megatron", *sys.argv[1:]]))
