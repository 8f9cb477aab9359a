#!/usr/bin/env bash
# W1 (engine only) of one shape in bf16 and each quantized setting, one after another on the same GPU in one
# device call, then the FP8 GEMM check. Usage, on a lent GPU machine from the repo root:
#
#     bash benchmarks/quantized_w1.sh SHAPE [SETTING ...]
#
# SETTING: bf16 | fp8 (--quantization fp8: weights quantized at load, activations per token) | fp8-kv
# (--kv-cache-dtype fp8) | fp8+fp8-kv. Default: all four. JSON lands in $OUT as w1_<shape>_<setting>.json.
set -euo pipefail
source scripts/device_env.sh
shape=$1
shift
settings=("$@")
[ ${#settings[@]} -gt 0 ] || settings=(bf16 fp8 fp8-kv fp8+fp8-kv)
for setting in "${settings[@]}"; do
  case "$setting" in
    bf16) flags="" ;;
    fp8) flags="--quantization fp8" ;;
    fp8-kv) flags="--kv-cache-dtype fp8" ;;
    fp8+fp8-kv) flags="--quantization fp8 --kv-cache-dtype fp8" ;;
    *) echo "unknown setting $setting" >&2; exit 2 ;;
  esac
  python3 benchmarks/offline_throughput.py --shape "$shape" --skip-hf --engine-flags="$flags" --tag "$setting"
done
