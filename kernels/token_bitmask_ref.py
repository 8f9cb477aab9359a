"""The grammar mask of constrained decoding, as a torch reference: the allowed-token bitmask of some rows applied
to their logits (masked tokens become -inf), in place.

Why a packed bitmask: the grammar engine (llguidance, on the host) writes one bit per vocabulary token, bit j of
int32 word i allowing token 32 * i + j, so a row's mask is V / 8 bytes to copy to the device, not V floats.
Tokens past the mask's last word (a model vocabulary padded beyond the tokenizer's) are always masked.

Contract shared with kernels/triton_token_bitmask.py (tested bit for bit under TRITON_INTERPRET=1):
- logits float [N, V], modified in place;
- bitmask int32 [M, W] (any W; W * 32 may be less or more than V);
- rows int64 [M]: the logits row each bitmask row applies to (distinct); other rows are untouched.
"""

from __future__ import annotations

import torch


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [M, vocab_size]: which tokens each bitmask row allows (False past its last word)."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().reshape(bitmask.shape[0], -1)
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    padding = torch.zeros(bitmask.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, padding], dim=1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Sets the logits of the tokens each row's bitmask disallows to -inf (in place)."""
    if rows.numel() == 0:
        return
    allowed = allowed_tokens(bitmask, logits.shape[1])
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
