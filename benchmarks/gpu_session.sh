#!/usr/bin/env bash
# The checks a lent GPU runs in one call (device tool: `run`, carry .whl), part by part, each
# under its own time limit so one stuck part cannot cost the others; results land in $OUT.
#
#   bash benchmarks/gpu_session.sh PART [PART ...]
#
# Parts: tests (the Triton kernels and CUDA graphs on the GPU); lora-tests (LoRA's CUDA tests and
# the graph tests alone); lora (issue 33: 4 adapters vs base on CUDA, with per-step profiles and
# cProfiles of the host); gemv-sweep (the packed GEMV's configs on the 1B shapes); gpu (issue 31: benchmarks/gpu.py's graphs part + a
# served run, sync, saturation, 4 API servers); full-graphs (the same with cudagraph_mode FULL:
# mixed steps replay graphs too); ttft (the graphs part alone); quant (issue 29:
# batch-1 and offline of bf16 / fp8 / Q8_0 / Q4_K_M); quant-async (the packed files, async).
# .whl holds the wheels the device image lacks (msgspec, pyzmq, fastapi, ...: see
# /work/.library/device's README for the download line).
set -u
OUT=${OUT:-/tmp/kvserve-gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KVSERVE_CACHE_DIR=/tmp/kvserve-cache
MODELS=$PWD/benchmarks/.models
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
echo "host: $(lscpu | grep -m1 'Model name' | sed 's/.*: *//'), $(nproc) CPUs"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
quiet() { grep -v -e USDT -e '^\s*$'; }
# CUDA tests into $OUT/LOG.log (-v: each test's name and result survive a run the time limit
# cuts), the C++ CPU kernels' bad-input tests left out (they segfault on the device's Xeon).
cuda_tests() {
    local log=$1 limit=$2; shift 2
    timeout "$limit" python3 -m pytest -v --tb=short -p no:cacheprovider \
        -k "not cpu_kernel and not dispatch and not some_of_the_groups" "$@" > "$OUT/$log.log" 2>&1
    grep -E "FAILED|ERROR|passed|failed" "$OUT/$log.log" | tail -15
}
for part in "$@"; do
    start=$(date +%s)
    case $part in
    tests)
        cuda_tests tests 240 tests/attention/test_triton_kernels.py \
            tests/attention/test_cuda_graph.py tests/lora/test_lora_kernels.py \
            tests/lora/test_lora_graph_mode.py tests/ops/test_triton_quant.py ;;
    lora-tests)
        cuda_tests lora_tests 150 tests/lora/test_lora_kernels.py \
            tests/lora/test_lora_graph_mode.py tests/attention/test_cuda_graph.py ;;
    lora)
        timeout 150 python3 benchmarks/lora.py --device cuda --full --num-prompts 128 \
            --adapters 4 --rounds 2 --skip-peft --profile-steps 8 --model-dir "$MODELS" \
            --host-profile-dir "$OUT" --output-json "$OUT/lora.json" 2>&1 | quiet \
            | grep -v "^profile" | tail -20 ;;
    gemv-sweep)
        timeout 120 python3 benchmarks/quant_gpu.py --gemv-sweep --skip-e2e --types Q8_0 Q4_K Q6_K \
            --model-dir "$MODELS" --output-json "$OUT/gemv_sweep.json" 2>&1 | quiet | tail -8 ;;
    gpu)
        timeout 240 python3 benchmarks/gpu.py --parts graphs serve --serve-modes sync \
            --serve-rates inf --serve-api-server-count 4 --model-dir "$MODELS" \
            --output-json "$OUT/gpu.json" 2>&1 | quiet | tail -12 ;;
    full-graphs)
        timeout 240 python3 benchmarks/gpu.py --parts graphs serve --serve-modes sync \
            --serve-rates inf --serve-api-server-count 4 --cudagraph-mode FULL \
            --model-dir "$MODELS" --output-json "$OUT/gpu_full.json" 2>&1 | quiet | tail -12 ;;
    ttft)
        timeout 120 python3 benchmarks/gpu.py --parts graphs --skip-serve --model-dir "$MODELS" \
            --output-json "$OUT/gpu.json" 2>&1 | quiet | tail -6 ;;
    quant)
        timeout 240 python3 benchmarks/quant_gpu.py --skip-kernels --num-prompts 100 \
            --model-dir "$MODELS" --output-json "$OUT/quant.json" 2>&1 | quiet | tail -10 ;;
    quant-async)    # the packed files only, async scheduling (batch-1 is host-bound without)
        timeout 150 python3 benchmarks/quant_gpu.py --skip-kernels --num-prompts 32 \
            --variants Q8_0 Q4_K_M --async-scheduling --model-dir "$MODELS" \
            --output-json "$OUT/quant_async.json" 2>&1 | quiet | tail -6 ;;
    *) echo "unknown part $part" ;;
    esac
    echo "== part $part: $(( $(date +%s) - start )) s"
done
