#!/usr/bin/env bash
# The GPU checks, as one script for a session lent a GPU machine (the device tool's `run`). Three parts,
# each a call of its own that ends inside 540 s (their timeouts sum to 480 s each); a session's 15
# minutes of device time hold one part with room to rerun it, so a session picks the part its issue needs:
#     run(command="bash scripts/gpu_checks.sh kernels", timeout_s=540)
#     run(command="bash scripts/gpu_checks.sh serving", carry=[".whl"], timeout_s=540)
#     run(command="bash scripts/gpu_checks.sh engine", timeout_s=540)
#     run(command="bash scripts/gpu_checks.sh train", carry=[".whl"], timeout_s=540)
# The machine's image has python3 with torch, triton, transformers and pytest, no megatron-core and no
# virtualenv. The serving and train parts need megatron-core as a wheel in .whl/ (ignored by git; fetch it here with
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.19.2
# ). Logs land in $OUT (they come back); record the numbers, with the date and the command, in
# docs/benchmarks.md.
#   kernels (issue 7):
#     tests/kernels on CUDA: the fused kernels compiled for the GPU against the torch reference (forward,
#     backward, fp32/bf16, odd shapes, padded vocabularies, main_grad, TP=2 over gloo);
#     benchmarks/bench_fused_logprobs.py: eager vs chunked vs fused vs the GEMM floor, N in {1k, 4k, 8k},
#     H=4096, V=151936, bf16.
#   serving (issue 5; one GPU shared by the trainer and serve-local --device cuda, as colocated placement):
#     tests/utils/test_storage_park.py: park/restore of CUDA storages into cudaHostRegister-ed host memory;
#     tests/trainer/test_offload.py: the trainer offload of a Megatron actor, fp32 and bf16, bit for bit;
#     tests/rollout/test_cuda_server.py: CUDA-IPC weight pushes, a memory release seen by another
#     process, `armor train` (bf16, offload, release) on one GPU beside its servers;
#     benchmarks/bench_weight_sync.py --device cuda: CUDA-IPC sync against a device-to-device copy.
#   engine (issue 18; needs no megatron-core):
#     tests/rollout/test_cuda_local_engine.py: the in-process engine on the GPU in bf16 and fp32, logprobs
#     against a full forward of the same weights on the GPU;
#     benchmarks/bench_rollout.py --vs-hf --device cuda --dtype bfloat16: the engine against HF generate.
#   train (issue 29; `train --dry-run` runs the same on the CPU with the tests' tiny model, as tests/test_train_check.py):
#     benchmarks/train_check.py: 20 ARMOR steps of a ~0.5B Qwen2-shaped model (random weights) with the recipes'
#     settings (bf16, distributed optimizer, fused head, Transformer Engine's spec if installed, the in-process engine
#     on the GPU), a checkpoint resumed for two steps; step time, tokens/s, TFLOP/s against `armor plan`'s FLOPs,
#     peak memory against its estimate and the logprob mismatch in $OUT/train_check.json (docs/benchmarks.md).
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
PARTS=${*:?name the part to run: kernels, serving, engine or train (see the header)}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if [[ $PARTS == "train --dry-run" ]]; then  # the train part's CPU path (the caller's python and megatron-core)
  exec timeout 300 "${PYTHON:-python3}" benchmarks/train_check.py --device cpu --out "$OUT/train_check.json" \
    --workdir "$OUT/work"
fi
unpack_megatron_wheel() {  # a wheel is a zip; no pip needed
  ls .whl/megatron_core-*.whl >/dev/null 2>&1 || { echo "$1: no megatron-core wheel in .whl/ (see the header)"; exit 1; }
  python3 -m zipfile -e .whl/megatron_core-*.whl /tmp/site || exit 1
  export PYTHONPATH=$PWD:/tmp/site
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
status=0
for part in $PARTS; do
  case $part in
    kernels)
      timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tee "$OUT/kernel_tests.log" || status=1
      timeout 240 python3 benchmarks/bench_fused_logprobs.py 2>&1 | tee "$OUT/bench_fused_logprobs.txt" || status=1
      ;;
    serving)
      unpack_megatron_wheel serving
      # Deterministic cuBLAS for the offload's bit-for-bit training comparison.
      CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 300 python3 -m pytest -q -rs -s -p no:cacheprovider \
        tests/utils/test_storage_park.py tests/trainer/test_offload.py tests/rollout/test_cuda_server.py 2>&1 \
        | tee "$OUT/serving_tests.log" || status=1
      (cd benchmarks && timeout 190 python3 bench_weight_sync.py --device cuda --hidden 2048 --layers 4 --repeats 3) 2>&1 \
        | tee "$OUT/bench_weight_sync_cuda.txt" || status=1
      ;;
    engine)
      timeout 200 python3 -m pytest -q -rs -p no:cacheprovider tests/rollout/test_cuda_local_engine.py 2>&1 \
        | tee "$OUT/engine_tests.log" || status=1
      timeout 280 python3 benchmarks/bench_rollout.py --vs-hf --device cuda --dtype bfloat16 --repeats 5 2>&1 \
        | tee "$OUT/bench_rollout_cuda.txt" || status=1
      ;;
    train)
      unpack_megatron_wheel train
      timeout 480 python3 benchmarks/train_check.py --device cuda --out "$OUT/train_check.json" 2>&1 \
        | tee "$OUT/train_check.log" || status=1
      ;;
    *) echo "unknown part $part (kernels, serving, engine, train)"; exit 2 ;;
  esac
done
exit $status
