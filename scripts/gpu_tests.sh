#!/usr/bin/env bash
# `make test-gpu` on a lent GPU machine, where our venv is not (docs/develop/gpu_tests.md): installs the wheels
# carried in .whl/ and regenerates the gRPC stubs (scripts/device_env.sh), then runs the tests marked `gpu`
# under tests/gpu/ with compiled Triton kernels. Arguments go to pytest. With --deletion-checks first,
# scripts/gpu_deletion_checks.py runs beside them (each feature deleted in a copy: its tests must fail).
#
#   bash scripts/gpu_tests.sh [--deletion-checks] [PYTEST_ARGS...]
cd "$(dirname "$0")/.." || exit 1
deletion_checks=0
if [ "${1:-}" = "--deletion-checks" ]; then
  deletion_checks=1
  shift
fi
source scripts/device_env.sh || exit 1
out=${OUT:-.}
if [ $deletion_checks = 1 ]; then
  python3 scripts/gpu_deletion_checks.py >"$out/deletion_checks.txt" 2>&1 &
  checks=$!
fi
set -o pipefail
TRITON_INTERPRET=0 python3 -m pytest -m gpu tests/gpu "$@" 2>&1 | tee "$out/gpu_tests.log"
status=$?
if [ $deletion_checks = 1 ]; then
  wait $checks
  checks_status=$?
  echo "== deletion checks (exit $checks_status; details in $out/deletion_checks.log)"
  cat "$out/deletion_checks.txt"
  [ $checks_status = 0 ] || status=1
fi
exit $status
