#!/usr/bin/env bash
# Issue 36's GPU measurements in as few device calls as the 10-minute limit allows. On a lent GPU machine, from the
# repo root (the wheels in .whl/ and scripts/device_env.sh as for scripts/gpu_tests.sh):
#
#     bash benchmarks/quantization_gpu.sh kernels            # ~3 min: tests/gpu's quantized kernels, the W4A16
#                                                            # GEMM and the FP8 GEMM per Llama-3.1-8B projection
#     bash benchmarks/quantization_gpu.sh w1 SETTING...      # W1 + lone TPOT of the 8B shape per setting (about
#                                                            # 1.5 min each: bf16 fp8+fp8-kv awq gptq w8a16 w8a8)
#
# Everything lands in $OUT (JSON, logs, plots) and in one tarball $OUT/quantization_gpu.tgz (the device tool
# returns a handful of files).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
source scripts/device_env.sh || exit 1
out=${OUT:-.}
what=${1:?kernels or w1}
shift
status=0
case "$what" in
  kernels)
    TRITON_INTERPRET=0 python3 -m pytest -q -m gpu tests/gpu/test_quantized_kernels_gpu.py >"$out/quantized_kernels_gpu.log" 2>&1 || status=1
    tail -3 "$out/quantized_kernels_gpu.log"
    python3 -m benchmarks.wna16_gemm_gpu --out "$out/wna16_gemm_gpu.json" >"$out/wna16_gemm_gpu.log" 2>&1 || status=1
    OUT=$out python3 -m benchmarks.fp8_linear_gpu >"$out/fp8_linear_gpu.log" 2>&1 || status=1
    ;;
  w1)
    OUT=$out bash benchmarks/quantized_w1.sh llama-3.1-8b "$@" >"$out/quantized_w1.log" 2>&1 || status=1
    python3 benchmarks/summarize_w1.py "$out" >"$out/quantized_w1_summary.json" || status=1
    cat "$out/quantized_w1_summary.json"
    ;;
  *) echo "unknown: $what (kernels or w1)" >&2; exit 2 ;;
esac
(cd "$out" && tar czf quantization_gpu.tgz --exclude quantization_gpu.tgz ./*) || status=1
exit $status
