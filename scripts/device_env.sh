#!/usr/bin/env bash
# Source on a lent GPU machine (see ../.library/device/README.md): installs the carried wheels (.whl/: pyzmq,
# grpcio-health-checking, gguf, grpcio-tools matching the machine's grpcio) and regenerates the gRPC stubs
# with that grpcio-tools, since stubs from a newer grpcio-tools refuse to import under an older grpcio.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. protos/pagedserve/v1/generate.proto protos/pagedserve/v1/worker.proto || return 1
