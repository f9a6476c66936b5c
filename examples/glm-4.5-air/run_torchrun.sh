#!/usr/bin/env bash
# ARMOR on GLM-4.5-Air with rollout routing replay (R3), trainer under torchrun; rollouts from SGLang servers you
# started. Hardware: 16 nodes x 8 H200 (141 GB). Nodes 0-7 (64 GPUs) train (tp 8 x pp 2 x dp 4, ep 4); nodes 8-15
# (64 GPUs) run 8 SGLang servers with TP 8, one a node: 6 serve the policy, 2 the reference (anchors). The policy's
# servers must record the experts they route to (train.routing_replay rollout asks every request for them):
#   python -m sglang.launch_server \
#     --model-path $MODEL --host 0.0.0.0 --port 30000 --tp-size 8 --mem-fraction-static 0.8 \
#     --random-seed $((1234 + 8*i)) --skip-tokenizer-init --dtype bfloat16 --enable-return-routed-experts
# Then run this script on every training node with NODE_RANK=0..7 and MASTER_ADDR=<node 0>, and
# SGLANG_URLS / SGLANG_REF_URLS the comma-separated http://host:port lists of the two server sets.
# Nothing here has run (examples/glm-4.5-air/armor.yaml's header says what ran on CPU).
set -euo pipefail
: "${NODE_RANK:?}" "${MASTER_ADDR:?}" "${SGLANG_URLS:?}" "${SGLANG_REF_URLS:?}"
cd "$(dirname "$0")/../.."
torchrun --nnodes 8 --nproc-per-node 8 --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port 29500 \
  -m megatron_armor.cli train --config examples/glm-4.5-air/armor.yaml \
  --rollout.backend sglang --rollout.sglang.urls "$SGLANG_URLS" --rollout.sglang.ref_urls "$SGLANG_REF_URLS" "$@"
