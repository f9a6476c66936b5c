#!/usr/bin/env bash
# The GPU checks, as one script for a session lent a GPU machine (the device tool's `run`):
#     run(command="bash scripts/gpu_checks.sh", timeout_s=540)
# The machine's image has python3 with torch, triton and pytest, which is all the kernels need (no
# megatron-core, no virtualenv). Logs land in $OUT (they come back); record the numbers, with the date
# and this command, in docs/benchmarks.md.
#   1. tests/kernels on CUDA: the fused kernels compiled for the GPU against the torch reference
#      (forward, backward, fp32/bf16, odd shapes, padded vocabularies, main_grad, TP=2 over gloo);
#   2. benchmarks/bench_fused_logprobs.py: eager vs chunked vs fused vs the GEMM floor, N in {1k, 4k, 8k},
#      H=4096, V=151936, bf16 (issue 7's table);
#   3. tests/trainer/test_storage_park.py: the trainer offload's park/restore of CUDA storages into
#      cudaHostRegister-ed host memory (rollout.offload_trainer; its Megatron-level tests need megatron-core).
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
status=0
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tee "$OUT/kernel_tests.log" || status=1
timeout 240 python3 benchmarks/bench_fused_logprobs.py 2>&1 | tee "$OUT/bench_fused_logprobs.txt" || status=1
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/trainer/test_storage_park.py 2>&1 | tee "$OUT/offload_tests.log" || status=1
exit $status
