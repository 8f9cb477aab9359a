#!/usr/bin/env bash
# W1 (engine only) of one shape in bf16 and each quantized setting, one after another on the same GPU in one
# device call, then the FP8 GEMM check. Usage, on a lent GPU machine from the repo root:
#
#     bash benchmarks/quantized_w1.sh SHAPE [SETTING ...]
#
# SETTING: bf16 | fp8 (--quantization fp8: weights quantized at load, activations per token) | fp8-kv
# (--kv-cache-dtype fp8) | fp8+fp8-kv | awq (AWQ W4A16, group 128) | gptq (GPTQ W4A16, group 128, symmetric) |
# w8a16 (compressed-tensors W8A16, per channel) | w8a8 (compressed-tensors INT8 W8A8, per-channel weights,
# per-token activations). The integer settings write the format's quantization_config
# into the shape's config.json (random integer weights: --load-format dummy). Default: bf16 and the FP8
# settings. JSON lands in $OUT as w1_<shape>_<setting>.json (W1 and the lone-request TPOT). $W1_EXTRA: more flags
# for offline_throughput.py (e.g. "--num-requests 16" when only the lone-request TPOT is wanted).
set -euo pipefail
source scripts/device_env.sh
shape=$1
shift
settings=("$@")
[ ${#settings[@]} -gt 0 ] || settings=(bf16 fp8 fp8-kv fp8+fp8-kv)
w8a16='{"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
 "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null, "format": "pack-quantized",
 "weights": {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "channel", "group_size": null}}}}'
w8a8='{"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
 "config_groups": {"group_0": {"targets": ["Linear"], "format": "int-quantized",
 "weights": {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "channel", "dynamic": false},
 "input_activations": {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "token", "dynamic": true}}}}'
for setting in "${settings[@]}"; do
  # The floor of each setting: bytes per decoder weight (4-bit: 0.5 + a 16-bit scale and zero per 128), bytes per
  # KV value, the prefill's tensor-core rate.
  flags="" qc="null" floor="--floor-linear-bytes 2 --floor-kv-bytes 2 --floor-matmul bf16"
  case "$setting" in
    bf16) ;;
    fp8) flags="--quantization fp8" floor="--floor-linear-bytes 1 --floor-matmul fp8" ;;
    fp8-kv) flags="--kv-cache-dtype fp8" floor="--floor-kv-bytes 1" ;;
    fp8+fp8-kv) flags="--quantization fp8 --kv-cache-dtype fp8"
                floor="--floor-linear-bytes 1 --floor-kv-bytes 1 --floor-matmul fp8" ;;
    awq) qc='{"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true, "version": "gemm"}'
         floor="--floor-linear-bytes 0.53" ;;
    gptq) qc='{"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": true, "desc_act": false}'
          floor="--floor-linear-bytes 0.52" ;;
    w8a16) qc="$w8a16" floor="--floor-linear-bytes 1" ;;
    w8a8) qc="$w8a8" floor="--floor-linear-bytes 1 --floor-matmul int8" ;;
    *) echo "unknown setting $setting" >&2; exit 2 ;;
  esac
  # shellcheck disable=SC2086  # $floor and $W1_EXTRA are several flags
  python3 benchmarks/offline_throughput.py --shape "$shape" --skip-hf --engine-flags="$flags" --tag "$setting" \
    --quantization-config "$qc" $floor ${W1_EXTRA:-}
done
