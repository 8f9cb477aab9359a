"""Which attention backend a worker runs: Triton kernels on a GPU, the pure-torch reference on the CPU."""

from __future__ import annotations

from kernels.attention_backend import AttentionBackend, TorchReferenceBackend
from worker_svc.config import WorkerConfig


def make_attention_backend(config: WorkerConfig) -> AttentionBackend:
    choice = config.attention_backend
    if choice == "auto":
        choice = "triton" if config.device.startswith("cuda") else "torch"
    if choice == "torch":
        return TorchReferenceBackend()
    from kernels.triton_backend import TritonAttentionBackend  # triton is imported only when used

    return TritonAttentionBackend()
