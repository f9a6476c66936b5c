#!/usr/bin/env bash
# ARMOR with LoRA on Qwen3-8B-Base, trainer under torchrun; rollouts from SGLang servers you started.
# Hardware: 16 nodes x 8 H100/H200 (80+ GB). Nodes 0-7 (64 GPUs) train (tp 4 x dp 16); nodes 8-15
# (64 GPUs) run 32 SGLang servers with TP 2 (20k-token responses): 24 serve the policy (they get the merged
# weights W + (alpha / r) B A after every update), 8 the reference: the base, which they load once and keep.
# On each rollout node, one server per GPU pair (policy and reference both start from model.path):
#   CUDA_VISIBLE_DEVICES=$((2*i)),$((2*i+1)) python -m sglang.launch_server --model-path $MODEL \
#     --host 0.0.0.0 --port $((30000 + i)) --tp-size 2 --mem-fraction-static 0.8 \
#     --random-seed $((1234 + 2*i)) --skip-tokenizer-init --dtype bfloat16
# Then run this script on every training node with NODE_RANK=0..7 and MASTER_ADDR=<node 0>, and
# SGLANG_URLS / SGLANG_REF_URLS the comma-separated http://host:port lists of the two server sets.
set -euo pipefail
: "${NODE_RANK:?}" "${MASTER_ADDR:?}" "${SGLANG_URLS:?}" "${SGLANG_REF_URLS:?}"
cd "$(dirname "$0")/../.."
torchrun --nnodes 8 --nproc-per-node 8 --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port 29500 \
  -m megatron_armor.cli train --config examples/qwen3-8b-base-lora/armor.yaml \
  --rollout.backend sglang --rollout.sglang.urls "$SGLANG_URLS" --rollout.sglang.ref_urls "$SGLANG_REF_URLS" "$@"
