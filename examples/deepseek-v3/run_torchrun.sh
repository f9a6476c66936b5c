#!/usr/bin/env bash
# ARMOR on DeepSeek-V3 with rollout routing replay (R3), trainer under torchrun; rollouts from SGLang servers you
# started. Hardware: 48 nodes x 8 H200 (141 GB). Nodes 0-31 (256 GPUs) train (tp 16 x pp 1 x dp 16, ep 256 at expert
# tp 1); nodes 32-47 (128 GPUs) run 8 SGLang servers with TP 16, two nodes each: 6 serve the policy, 2 the reference
# (anchors). The policy's servers must record the experts they route to (train.routing_replay rollout asks every
# request for them); server i runs on its two nodes (NODE_RANK 0 and 1 of the pair, SERVER_ADDR its first node):
#   python -m sglang.launch_server \
#     --model-path $MODEL --host 0.0.0.0 --port 30000 --tp-size 16 --nnodes 2 --node-rank $NODE_RANK \
#     --dist-init-addr $SERVER_ADDR:5000 --mem-fraction-static 0.8 --random-seed $((1234 + 16*i)) \
#     --skip-tokenizer-init --dtype bfloat16 --enable-return-routed-experts
# $MODEL is the bf16 checkpoint the trainer loads (examples/deepseek-v3/armor.yaml's header: cast the fp8 release).
# Then run this script on every training node with NODE_RANK=0..31 and MASTER_ADDR=<node 0>, and
# SGLANG_URLS / SGLANG_REF_URLS the comma-separated http://host:port lists of the two server sets (each server's
# first node).
# Nothing here has run (examples/deepseek-v3/armor.yaml's header says what ran on CPU).
set -euo pipefail
: "${NODE_RANK:?}" "${MASTER_ADDR:?}" "${SGLANG_URLS:?}" "${SGLANG_REF_URLS:?}"
cd "$(dirname "$0")/../.."
torchrun --nnodes 32 --nproc-per-node 8 --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port 29500 \
  -m megatron_armor.cli train --config examples/deepseek-v3/armor.yaml \
  --rollout.backend sglang --rollout.sglang.urls "$SGLANG_URLS" --rollout.sglang.ref_urls "$SGLANG_REF_URLS" "$@"
