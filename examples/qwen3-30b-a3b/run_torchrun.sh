#!/usr/bin/env bash
# ARMOR on Qwen3-30B-A3B with rollout routing replay (R3), trainer under torchrun; rollouts from SGLang servers you
# started. Hardware: 16 nodes x 8 H100/H200 (80+ GB). Nodes 0-7 (64 GPUs) train (tp 4 x dp 16, ep 8); nodes 8-15
# (64 GPUs) run 16 SGLang servers with TP 4: 12 serve the policy, 4 the reference (anchors). The policy's servers
# must record the experts they route to (train.routing_replay rollout asks every request for them):
#   CUDA_VISIBLE_DEVICES=$((4*i)),$((4*i+1)),$((4*i+2)),$((4*i+3)) python -m sglang.launch_server \
#     --model-path $MODEL --host 0.0.0.0 --port $((30000 + i)) --tp-size 4 --mem-fraction-static 0.8 \
#     --random-seed $((1234 + 4*i)) --skip-tokenizer-init --dtype bfloat16 --enable-return-routed-experts
# Then run this script on every training node with NODE_RANK=0..7 and MASTER_ADDR=<node 0>, and
# SGLANG_URLS / SGLANG_REF_URLS the comma-separated http://host:port lists of the two server sets.
set -euo pipefail
: "${NODE_RANK:?}" "${MASTER_ADDR:?}" "${SGLANG_URLS:?}" "${SGLANG_REF_URLS:?}"
cd "$(dirname "$0")/../.."
torchrun --nnodes 8 --nproc-per-node 8 --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port 29500 \
  -m megatron_armor.cli train --config examples/qwen3-30b-a3b/armor.yaml \
  --rollout.backend sglang --rollout.sglang.urls "$SGLANG_URLS" --rollout.sglang.ref_urls "$SGLANG_REF_URLS" "$@"
