"""KV cache quantization (`--kv-cache-dtype fp8`): the pool holds float8_e4m3fn, each layer has per-tensor K and V
scales, the cache write quantizes and the attention kernels dequantize on load.

Why per-tensor scales that are plain host floats: they are fixed when the model is loaded (from the checkpoint's
`k_scale` / `v_scale` tensors, or 1.0, as vLLM without --calculate-kv-scales), so a kernel takes them as scalar
arguments and a captured CUDA graph keeps them; nothing is read back from the device.

The arithmetic, the same in the torch reference (here) and the Triton kernels (triton_cache_write.py,
triton_paged_kv.py), and vLLM's:
- write: `fp8(clamp(x / scale, -448, 448))`, rounded to nearest even (448 is e4m3fn's largest finite value; without
  the clamp a cast of a larger value is NaN);
- read: `(float(cached) * scale)` rounded to the query's dtype; attention then runs as over a cache of that dtype
  (P @ V with P rounded to the query's dtype).
A cache of any other dtype ignores the scales: its writes cast and its reads are the stored values.

Who owns what: the model's attention layers hold their `KVScales` (worker_svc/layers/attention.py, filled by
worker_svc/models/kv_scales.py); the worker's KVCache holds the pool in the dtype `kv_cache_dtype` names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0
# --kv-cache-dtype values: "auto" keeps the model's dtype; vLLM's "fp8" means e4m3.
KV_CACHE_DTYPES = {"fp8": FP8_KV_DTYPE, "fp8_e4m3": FP8_KV_DTYPE}


@dataclass(frozen=True)
class KVScales:
    """One attention layer's dequantization scales: the stored value times `k` (`v`) is the key (value)."""

    k: float = 1.0
    v: float = 1.0

    def __post_init__(self) -> None:
        for name, scale in (("k_scale", self.k), ("v_scale", self.v)):
            if not (scale > 0 and scale != float("inf")):
                raise ValueError(f"KV cache {name} must be a positive finite number, not {scale}")


UNIT_KV_SCALES = KVScales()


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype for a --kv-cache-dtype value ("auto": the model's)."""
    return model_dtype if name == "auto" else KV_CACHE_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


def quantize(values: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """`values` as stored in a cache of `cache_dtype` (a plain cast unless it is fp8)."""
    if not is_fp8(cache_dtype):
        return values.to(cache_dtype)
    return (values.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(cache_dtype)


def dequantize(cached: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Stored values back in `dtype` (the query's); a cache that is not fp8 is returned as it is."""
    if not is_fp8(cached.dtype):
        return cached
    return (cached.float() * scale).to(dtype)
