#!/usr/bin/env bash
# MIPU on Qwen3-1.7B, trainer under torchrun; rollouts from FP8 SGLang servers you started.
# Hardware: 1 node x 8 H100 (80 GB). GPUs 0-3 train (dp 4); GPUs 4-7 run 4 SGLang servers with FP8 weights
# (the paper's high-mismatch setting), one per GPU:
#   CUDA_VISIBLE_DEVICES=$((4+i)) python -m sglang.launch_server --model-path $MODEL --host 0.0.0.0 \
#     --port $((30000 + i)) --quantization fp8 --mem-fraction-static 0.8 --random-seed $((1234 + i)) \
#     --skip-tokenizer-init --dtype bfloat16
# Then run this script with SGLANG_URLS the comma-separated http://host:port list of the four servers.
set -euo pipefail
: "${SGLANG_URLS:?}"
cd "$(dirname "$0")/../.."
CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun --nnodes 1 --nproc-per-node 4 --master-port 29500 \
  -m megatron_armor.cli train --config examples/qwen3-1.7b/mipu.yaml \
  --rollout.backend sglang --rollout.sglang.urls "$SGLANG_URLS" "$@"
