#!/usr/bin/env bash
# W1 (engine only, no peers) of another tree of pagedserve and of this one, alternately, on the same machine in
# one device call: a refactor's "W1 unchanged" check. Usage, on a lent GPU machine from the repo root:
#
#     bash benchmarks/w1_before_after.sh BEFORE_DIR ROUNDS SHAPE [SHAPE ...]
#
# BEFORE_DIR holds the other tree (e.g. `git archive <commit> | tar -x -C .before` here, then run with it in the
# working tree). Each round runs BEFORE then this tree for every shape; JSON lands in $OUT as
# w1_<shape>_before<round>.json and w1_<shape>_after<round>.json.
set -euo pipefail
source scripts/device_env.sh
before=$1 rounds=$2
shift 2
here=$PWD
(cd "$before" && python3 -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. \
  protos/pagedserve/v1/generate.proto protos/pagedserve/v1/worker.proto)
for round in $(seq 1 "$rounds"); do
  for shape in "$@"; do
    (cd "$before" && PYTHONPATH=/tmp/site:$PWD python3 benchmarks/offline_throughput.py --shape "$shape" --skip-hf \
      --tag "before$round")
    (cd "$here" && PYTHONPATH=/tmp/site:$PWD python3 benchmarks/offline_throughput.py --shape "$shape" --skip-hf \
      --tag "after$round")
  done
done
