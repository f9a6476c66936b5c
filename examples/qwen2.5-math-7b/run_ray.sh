#!/usr/bin/env bash
# ARMOR on Qwen2.5-Math-7B as one Ray job: trainer ranks and SGLang servers are Ray actors.
# Hardware: 16 nodes x 8 H100/H200 (80+ GB) in one Ray cluster (`ray start --head` on node 0,
# `ray start --address=<head>:6379` on the others), sglang installed on every node.
# Disaggregated placement: 64 GPUs train (tp 4 x dp 16), 64 GPUs serve: 48 policy + 16 reference
# servers with TP 1.
set -euo pipefail
cd "$(dirname "$0")/../.."
export RAY_ADDRESS="${RAY_ADDRESS:-auto}"
python -m megatron_armor.cli ray-train --config examples/qwen2.5-math-7b/armor.yaml \
  --placement disaggregated --num-servers 48 --num-ref-servers 16 --server-tp 1 --mem-fraction 0.8 \
  --server-arg=--dtype --server-arg=bfloat16 "$@"
