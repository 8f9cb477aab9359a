"""Torch reference of the multi-LoRA delta: each token adds its own adapter's low-rank product to a layer's output.

Why one call per layer part over the whole token axis: a batch mixes requests of several adapters (and of the
base model), so the adapter differs per token. `token_slots[t]` is token t's slot in the stacked weights
(-1: no adapter, the token is left untouched and costs nothing in a kernel that skips it). Stacked weights,
padded to the server's largest rank with zeros (which add nothing): `lora_a` [S, R, K], `lora_b` [S, N, R].

Rounding is PEFT's `lora_B(lora_A(x)) * scaling` added to the base layer's output, in x's dtype: the shrink
rounds to x's dtype, the expand rounds to it, the product with the scaling (taken in x's dtype) rounds, then
the add. The Triton kernel (kernels/triton_lora.py, where present) has the same signature and semantics.
"""

from __future__ import annotations

import torch


def lora_add(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             token_slots: torch.Tensor, scalings: torch.Tensor) -> None:
    """In place: y[t] += scalings[s] * ((x[t] @ lora_a[s].T) @ lora_b[s].T) for s = token_slots[t] >= 0.

    y [T, N] (a view is fine: a fused projection's part), x [T, K], token_slots [T] integer, scalings [S]."""
    for slot in torch.unique(token_slots).tolist():
        if slot < 0:
            continue
        tokens = (token_slots == slot).nonzero().squeeze(1)
        shrink = x[tokens] @ lora_a[slot].T
        expand = shrink @ lora_b[slot].T
        y[tokens] += expand * scalings[slot].to(x.dtype)
