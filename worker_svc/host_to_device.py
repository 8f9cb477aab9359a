"""Host-to-device copies that never make the host wait for the GPU.

Why: a copy from pageable host memory (a numpy array's buffer) is staged by the driver and the host returns
only once the stream has reached it, i.e. after everything queued before it has run. A worker that builds
step N+1 while the GPU still runs step N would then wait for step N at its first input copy. A pinned staging
buffer (torch's caching host allocator, which keeps it alive until the copy has run) makes the copy truly
asynchronous. On the CPU this is a plain conversion.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(host: np.ndarray | torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host array or CPU tensor on `device` (as `dtype`), without waiting for the GPU."""
    tensor = torch.from_numpy(np.ascontiguousarray(host)) if isinstance(host, np.ndarray) else host
    if dtype is not None:
        tensor = tensor.to(dtype)
    if device.type != "cuda":
        return tensor
    if not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def host_buffer(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty host tensor to pack a copy bound for `device` into: pinned when that is a GPU, so that
    `to_device` sends it as it is instead of staging it through another pinned copy."""
    return torch.empty(size, dtype=dtype, pin_memory=device.type == "cuda")
