"""The attention backend: the two paged-KV operations a model layer needs, behind one small interface.

Why an object passed into the model rather than imported functions: the model code stays identical
whether attention runs on the torch reference (CPU, tests) or on Triton kernels (GPU); the worker picks
the backend once when it builds the model.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kernels import paged_attention_ref
from kernels.attention_metadata import AttentionMetadata


class AttentionBackend(Protocol):
    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def paged_attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor: ...


class TorchReferenceBackend:
    """Backend over kernels/paged_attention_ref.py: exact, slow, runs anywhere."""

    def write_kv_cache(self, key, value, kv_cache, slot_mapping) -> None:
        paged_attention_ref.write_kv_cache(key, value, kv_cache, slot_mapping)

    def paged_attention(self, query, kv_cache, metadata, scale, sliding_window=None, logit_softcap=None):
        return paged_attention_ref.paged_attention(query, kv_cache, metadata, scale, sliding_window, logit_softcap)
