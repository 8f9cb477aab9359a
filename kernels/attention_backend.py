"""The attention backend: the two paged-KV operations a model layer needs, behind one small interface.

Why an object passed into the model rather than imported functions: the model code stays identical
whether attention runs on the torch reference (CPU, tests) or on Triton kernels (GPU); the worker picks
the backend once when it builds the model.

K/V scales (`kv_scales`): each layer's, for an fp8 cache (kernels/kv_quant.py); a cache of the model's dtype
ignores them. Host floats fixed at load, so a captured CUDA graph keeps them.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kernels import paged_attention_ref
from kernels.attention_metadata import AttentionMetadata
from kernels.kv_quant import UNIT_KV_SCALES, KVScales


class AttentionBackend(Protocol):
    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> None: ...

    def paged_attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> torch.Tensor: ...


class TorchReferenceBackend:
    """Backend over kernels/paged_attention_ref.py: exact, slow, runs anywhere."""

    def write_kv_cache(self, key, value, kv_cache, slot_mapping, kv_scales=UNIT_KV_SCALES) -> None:
        paged_attention_ref.write_kv_cache(key, value, kv_cache, slot_mapping, kv_scales)

    def paged_attention(self, query, kv_cache, metadata, scale, sliding_window=None, logit_softcap=None,
                        kv_scales=UNIT_KV_SCALES):
        return paged_attention_ref.paged_attention(query, kv_cache, metadata, scale, sliding_window, logit_softcap,
                                                   kv_scales)
