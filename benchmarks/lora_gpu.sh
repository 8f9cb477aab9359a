#!/usr/bin/env bash
# Issue 38 item 3's GPU runs (LoRA under CUDA graphs), one device call each. On a lent GPU machine, from the repo
# root (the wheels in .whl/ and scripts/device_env.sh as for scripts/gpu_tests.sh):
#
#     bash benchmarks/lora_gpu.sh kernels     # ~2 min: tests/gpu/test_lora_graphs_gpu.py (a decode graph with
#                                             # 3 adapters and base rows replays as the eager forward) and the
#                                             # LoRA kernels per Llama-3.1-8B layer, fused parts (benchmarks/lora_kernels_gpu.py)
#     bash benchmarks/lora_gpu.sh sweep       # ~1-2 min: the kernels' tiles at 1-16 tokens per 8B layer, the
#                                             # fastest per token count (benchmarks/lora_kernels_gpu.py --sweep)
#     bash benchmarks/lora_gpu.sh w1 [ARGS]   # ~6 min: W1 and lone TPOT of the 8B shape with 8 random rank-16
#                                             # adapters vs the base model, and vs an engine without --enable-lora
#                                             # (benchmarks/lora_w1.py; ARGS go to it, e.g. --skip-plain-engine)
#
# Everything lands in $OUT (JSON, logs) and in one tarball $OUT/lora_gpu.tgz.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
source scripts/device_env.sh || exit 1
out=${OUT:-.}
what=${1:?kernels, sweep or w1}
shift
status=0
case "$what" in
  kernels)
    TRITON_INTERPRET=0 python3 -m pytest -q -m gpu tests/gpu/test_lora_graphs_gpu.py >"$out/lora_graphs_gpu.log" 2>&1 || status=1
    tail -3 "$out/lora_graphs_gpu.log"
    python3 -m benchmarks.lora_kernels_gpu --out "$out/lora_kernels_gpu.json" >"$out/lora_kernels_gpu.log" 2>&1 || status=1
    cat "$out/lora_kernels_gpu.log"
    ;;
  sweep)
    python3 -m benchmarks.lora_kernels_gpu --sweep --out "$out/lora_sweep.json" >"$out/lora_sweep.log" 2>&1 || status=1
    cat "$out/lora_sweep.log"
    ;;
  w1)
    OUT=$out python3 benchmarks/lora_w1.py "$@" >"$out/lora_w1.log" 2>&1 || status=1
    tail -12 "$out/lora_w1.log"
    ;;
  *) echo "unknown: $what (kernels, sweep or w1)" >&2; exit 2 ;;
esac
(cd "$out" && tar czf lora_gpu.tgz --exclude lora_gpu.tgz ./*) || status=1
exit $status
