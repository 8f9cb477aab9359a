"""Torch reference of neox-style rotary embedding: the math of worker_svc/models/llama.py's RotaryEmbedding.

Why a standalone function: the Triton kernel (kernels/triton_rotary.py) is tested against it, and it is
checked to equal the model module bit for bit. The cos/sin table is fp32 `[max_positions, head_dim]`
(cos half | sin half), gathered by position and cast to the activation dtype before use, as HF does;
then each product and the sum round to the activation dtype (torch's elementwise ops), as in HF's
apply_rotary_pos_emb.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query [T, Hq, D] and key [T, Hkv, D] by their token positions [T]."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos = torch.cat([cos, cos], dim=-1)[:, None, :].to(query.dtype)
    sin = torch.cat([sin, sin], dim=-1)[:, None, :].to(query.dtype)
    return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin
