#!/usr/bin/env bash
# Issue 17's tensor-parallel scaling measurements on a machine of two GPUs (source scripts/device_env.sh first;
# results in $OUT), in parts that fit a device call; `python benchmarks/tp_scaling.py DIR` then summarizes them.
#   bash benchmarks/tp_scaling_gpu.sh w1           # W1 + lone-request TPOT: Llama-3.1-8B at -tp 1 and 2, Qwen3-30B-A3B at 2
#   bash benchmarks/tp_scaling_gpu.sh profile [TP]  # a 256-row and a 1-row decode step of the 8B shape at -tp 1 and 2
#   bash benchmarks/tp_scaling_gpu.sh correctness  # bf16 against transformers with -tp 2 (8B and 30B-A3B, 4 layers)
#   bash benchmarks/tp_scaling_gpu.sh allreduce    # all_reduce_bench.py; -tp 2 decode steps and W1 with NCCL only
#   bash benchmarks/tp_scaling_gpu.sh exact        # gpu_serve_check.py -tp 2: float32 greedy token-exact
# A failing part is recorded and the rest still run. NCCL's multicast switches stay as the machine sets them.
set -u
status=0
run() { echo "=== $*"; "$@" || { echo "FAILED($?): $*"; status=1; }; }
profile() {  # BATCH FLAGS...: one decode-step profile of the 8B shape, its table in a .txt beside the JSON
  local name; name="decode_step_llama-3.1-8b_b$1$(echo "${@:2}" | tr -d ' -' | sed 's/tensorparallelsize\|tp/_tp/;s/disablecustomallreduce/_nccl/')"
  run python3 benchmarks/profile_decode_step.py --shape llama-3.1-8b --batch "$@" --json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
  tail -1 "$OUT/$name.txt"
}
nvidia-smi topo -m > "$OUT/topology.txt" 2>&1 || true
case "${1:-}" in
  w1)
    run python3 benchmarks/offline_throughput.py --shape llama-3.1-8b --skip-hf -tp 1
    run python3 benchmarks/offline_throughput.py --shape llama-3.1-8b --skip-hf -tp 2
    run python3 benchmarks/offline_throughput.py --shape qwen3-30b-a3b --skip-hf -tp 2 ;;
  profile)  # [TP ...] (default 1 2)
    tps=("${@:2}"); [ ${#tps[@]} -gt 0 ] || tps=(1 2)
    for tp in "${tps[@]}"; do
      for batch in 256 1; do profile "$batch" -tp "$tp"; done
    done ;;
  allreduce)
    run python3 benchmarks/all_reduce_bench.py -tp 2
    for batch in 256 1; do profile "$batch" -tp 2 --disable-custom-all-reduce; done
    run python3 benchmarks/offline_throughput.py --shape llama-3.1-8b --skip-hf -tp 2 \
      --engine-flags=--disable-custom-all-reduce --tag nccl ;;
  exact)
    run python3 benchmarks/gpu_serve_check.py -tp 2 ;;
  correctness)
    run python3 benchmarks/gpu_correctness.py --shape llama-3.1-8b --num-layers 4 -tp 2
    run python3 benchmarks/gpu_correctness.py --shape qwen3-30b-a3b --num-layers 4 -tp 2 ;;
  *) echo "usage: $0 w1|profile|correctness"; exit 2 ;;
esac
exit $status
