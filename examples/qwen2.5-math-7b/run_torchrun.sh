#!/usr/bin/env bash
# ARMOR on Qwen2.5-Math-7B, trainer under torchrun; rollouts from SGLang servers you started.
# Hardware: 16 nodes x 8 H100/H200 (80+ GB). Nodes 0-7 (64 GPUs) train (tp 4 x dp 16); nodes 8-15
# (64 GPUs) run 64 SGLang servers with TP 1: 48 serve the policy, 16 the reference (anchors).
# On each rollout node, one server per GPU (policy and reference both start from model.path):
#   CUDA_VISIBLE_DEVICES=$g python -m sglang.launch_server --model-path $MODEL --host 0.0.0.0 \
#     --port $((30000 + g)) --tp-size 1 --mem-fraction-static 0.8 --random-seed $((1234 + g)) \
#     --skip-tokenizer-init --dtype bfloat16
# Then run this script on every training node with NODE_RANK=0..7 and MASTER_ADDR=<node 0>, and
# SGLANG_URLS / SGLANG_REF_URLS the comma-separated http://host:port lists of the two server sets.
set -euo pipefail
: "${NODE_RANK:?}" "${MASTER_ADDR:?}" "${SGLANG_URLS:?}" "${SGLANG_REF_URLS:?}"
cd "$(dirname "$0")/../.."
torchrun --nnodes 8 --nproc-per-node 8 --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port 29500 \
  -m megatron_armor.cli train --config examples/qwen2.5-math-7b/armor.yaml \
  --rollout.backend sglang --rollout.sglang.urls "$SGLANG_URLS" --rollout.sglang.ref_urls "$SGLANG_REF_URLS" "$@"
