#!/usr/bin/env bash
# The GPU checks of issues 5/6 as one prepared script for a session with a device (H200 image:
# torch, triton, transformers; no gradio/gguf; nothing downloadable). Results go under $OUT
# (default bench/results/gpu/). Stages, each under the 600 s a device call allows:
#   bash bench/gpu_checks.sh tests    # tests/gpu (engine + kernels), ~3 min; runs them all (no -x)
#                                     # + tests/gpu/test_new_kernels_gpu.py (W8A16 GEMM; sliding-window and
#                                     # soft-capped attention; 83 tests) and test_engine_gpu.py's Gemma 2 test:
#                                     # an estimate, not measured yet, of 3-5 min more (most of it Triton
#                                     # compiling ~80 kernel variants), so ~6-8 min; `first` leaves the new
#                                     # kernels' file to the `newkernels` stage (its 240 s cap would cut it)
#   bash bench/gpu_checks.sh e2e      # Llama-2-7B shape, W4 + INT8 KV vs transformers fp16, ~8 min
#   bash bench/gpu_checks.sh memory MODEL  # the memory table measured by the engine for one model
#                                     # (llama-3-8b or llama-2-7b: 12 engine starts, ~5 min each)
#   bash bench/gpu_checks.sh kernels  # bench/kernels/gpu_kernels.py --quick: issue 5 figures (GEMM incl. swap_ab, attention)
#                                     # and the PDL decode chain (extra arguments go to it, e.g. --skip attn)
#   bash bench/gpu_checks.sh tune     # bench/kernels/tune_w4a16.py: the W4A16 launch per shape and M on this GPU, written
#                                     # to kernels/configs/w4a16_<device>.json and $OUT after every pair; starts
#                                     # no new pair after --budget-s (default 420 s; a full run is ~11 min:
#                                     # copy the returned file into kernels/configs/ and call again with
#                                     # --skip-done). Extra arguments go to it, e.g. --budget-s 240 --m 1 2 4 8 16.
#                                     # Commit the file.
#   bash bench/gpu_checks.sh smollm2  # SmolLM2 AWQ + INT8 KV, GPU vs CPU: the second of two calls that
#                                     # bring the model (see bench/gpu_assets.py), ~1 min
#   bash bench/gpu_checks.sh moe      # MoE (issue 18): tests/gpu/test_moe_gpu.py, then bench/kernels/moe_gpu.py --quick (fused
#                                     # kernel vs per-expert loop vs dense W4 of the same active size), ~4 min
#   bash bench/gpu_checks.sh newkernels  # tests/gpu/test_new_kernels_gpu.py alone (W8A16, window + softcap attention)
#   bash bench/gpu_checks.sh first    # tests, then tune with what is left of 540 s (one machine start for both:
#                                     # each start costs 1-2 minutes of a session's 15); extra arguments go to tune
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results/gpu}"
PY="${PYTHON:-python3}"  # the device image's interpreter with torch is python3
mkdir -p "$OUT"
$PY -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 || true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
case "${1:-tests}" in
  tests)
    $PY -m pytest -q -rA tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" | tail -30 ;;
  e2e)
    # transformers runs first (its 13.5 GB model is freed before the engine sizes its KV pool);
    # 32 of the 256 requests (one static batch) time it (a rate), all 256 time lightinfer.
    $PY -m bench.serving.e2e bench/configs/llama-2-7b --dummy-weights --quantization awq --kv-cache-dtype int8 \
      --dtype float16 --hf-num-prompts 32 --out-dir "$OUT" 2>&1 | tee "$OUT/e2e_llama-2-7b.log" | tail -20 ;;
  memory)
    $PY -m bench.serving.memory_table --measure --models "${2:-llama-3-8b}" --out-dir "$OUT" 2>&1 \
      | tee "$OUT/memory_table_${2:-llama-3-8b}.log" | tail -20 ;;
  kernels)
    $PY -m bench.kernels.gpu_kernels --quick --out "$OUT/gpu_kernels.json" "${@:2}" 2>&1 | tee "$OUT/gpu_kernels.log" | tail -30 ;;
  tune)
    $PY -m bench.kernels.tune_w4a16 --copy-to "$OUT" "${@:2}" 2>&1 | tee "$OUT/tune_w4a16.log" | tail -30 ;;
  first)
    start=$SECONDS
    # the new-kernel tests (3-5 min of compiles, estimated) have a stage of their own: `newkernels`
    timeout 240 $PY -m pytest -q -rA tests/gpu --ignore=tests/gpu/test_new_kernels_gpu.py 2>&1 \
      | tee "$OUT/gpu_tests.log" | tail -15
    $PY -m bench.kernels.tune_w4a16 --copy-to "$OUT" --budget-s $((540 - (SECONDS - start) - 90)) "${@:2}" 2>&1 \
      | tee "$OUT/tune_w4a16.log" | tail -15 ;;
  smollm2)
    $PY bench/gpu_assets.py join && $PY -m pytest -q -s tests/gpu/test_engine_gpu.py -k smollm2 2>&1 \
      | tee "$OUT/smollm2_gpu_vs_cpu.log" | tail -20 ;;
  newkernels)
    timeout 540 $PY -m pytest -q -rA tests/gpu/test_new_kernels_gpu.py 2>&1 | tee "$OUT/new_kernels_gpu.log" | tail -20 ;;
  moe)
    timeout 240 $PY -m pytest -q -rA tests/gpu/test_moe_gpu.py 2>&1 | tee "$OUT/moe_gpu_tests.log" | tail -15
    timeout 300 $PY -m bench.kernels.moe_gpu --quick --out "$OUT/moe_gpu.json" 2>&1 | tee "$OUT/moe_gpu.log" | tail -20 ;;
  *) echo "unknown stage $1 (tests | newkernels | tune | kernels | e2e | memory | smollm2 | moe | first)"; exit 2 ;;
esac
