#!/usr/bin/env bash
# Issue 16's GPU measurements (source scripts/device_env.sh first; results in $OUT), in parts that fit a device call:
#   bash benchmarks/model_breadth_gpu.sh correctness [SHAPE ...]  # gpu_correctness.py per family (default: all)
#   bash benchmarks/model_breadth_gpu.sh w1 [SHAPE ...]           # W1 vs Hugging Face (default: the three below)
# Windowed shapes run with a 64-token window so the prompts (20-300 tokens) cross it; 4 to 6 layers keep the bf16
# comparison meaningful (gpu_correctness.py says why). A failing part is recorded and the rest still run.
set -u
declare -A CORRECTNESS_ARGS=(
  [qwen3-8b]="--num-layers 4"
  [gemma-2-9b]="--num-layers 4 --override sliding_window=64"
  [gemma-3-4b]="--num-layers 6 --override sliding_window=64"
  [mistral-7b]="--num-layers 4 --override sliding_window=64"
  [phi-3-mini-128k]="--num-layers 4"
  [opt-125m]=""
  [qwen3-30b-a3b]="--num-layers 4"
  [mixtral-8x7b]="--num-layers 4"
)
status=0
run() { echo "=== $*"; "$@" || { echo "FAILED($?): $*"; status=1; }; }
part="${1:-}"; shift || true
case "$part" in
  correctness)
    shapes=("$@"); [ ${#shapes[@]} -gt 0 ] || shapes=(qwen3-8b gemma-2-9b gemma-3-4b mistral-7b phi-3-mini-128k opt-125m qwen3-30b-a3b mixtral-8x7b)
    for shape in "${shapes[@]}"; do
      # shellcheck disable=SC2086
      run python3 benchmarks/gpu_correctness.py --shape "$shape" ${CORRECTNESS_ARGS[$shape]}
    done ;;
  w1)
    shapes=("$@"); [ ${#shapes[@]} -gt 0 ] || shapes=(qwen3-8b gemma-2-9b qwen3-30b-a3b)
    for shape in "${shapes[@]}"; do
      run python3 benchmarks/offline_throughput.py --shape "$shape" --hf-peers hf_static_batch64
    done ;;
  *) echo "usage: $0 correctness|w1 [SHAPE ...]"; exit 2 ;;
esac
exit $status
