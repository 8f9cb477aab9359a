"""Torch reference of batched multi-LoRA: add each token's own adapter's low-rank update to a projection's output.

Why one call for a whole batch: multi-LoRA serving puts the rows of many adapters (and of none) in one step, so
the update is a gather by slot, not one adapter's matmul (Punica's "shrink" x A^T to the rank, then "expand" by
B^T back to the output width). Who owns what: the caller (the LoRA layers) holds the stacked adapter weights of
all slots, `lora_a` [S, R, K] and `lora_b` [S, N, R] in x's dtype, each adapter's rank padded with zeros to the
common R, and `scalings` [S] float32 (lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA); a step's
`token_slots` [T] says which slot each token uses, -1 for none (base model, or a padding row of a CUDA graph).

Numerics, which the Triton version (kernels/triton_lora.py) follows, mirror PEFT's `lora_B(lora_A(x)) * scaling`
added to the base output: h = x A^T summed in fp32 and rounded to x's dtype; d = h B^T likewise; d times the
scaling computed in fp32 and rounded to x's dtype (PEFT multiplies its dtype tensor by a Python float, which
torch applies in fp32 for 16-bit tensors); then y + that, rounded to y's dtype.

A fused projection (q|k|v, gate|up) runs every part's update in one call (`lora_add_fused`): its parts share x,
so their A stack to [S, P*R, K] (part p's at rows p*R..), and B to [S, N, R] over the parts' output columns in
order; each part rounds exactly as its own `lora_add` would (the Triton version launches once per layer).

This file loops over the slots present (a host sync: not for CUDA graphs; the Triton version has none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

BASE_KEY = 1 << 30  # sort key of a base token (slot -1): after every slot


@dataclass(frozen=True)
class LoraTokens:
    """A step's LoRA token slots and the same tokens ordered by slot, made once per step and read by every layer.

    Why the order: the Triton kernels give each program a tile of tokens of one slot (kernels/triton_lora.py), so
    they need the tokens grouped by slot; sorting once per step (on the device, no host sync, inside the CUDA
    graphs: replayed with the slots) saves every layer a sort. `slots` [T]: each token's slot, -1 none;
    `order` [T] int32: the token rows sorted by slot, stable, base tokens last; `sorted_slots` [T] int32:
    slots[order]."""

    slots: torch.Tensor
    order: torch.Tensor
    sorted_slots: torch.Tensor

    @classmethod
    def of(cls, token_slots: torch.Tensor) -> LoraTokens:
        keys = torch.where(token_slots < 0, BASE_KEY, token_slots.long())
        _, order = torch.sort(keys, stable=True)
        return cls(token_slots, order.to(torch.int32), token_slots[order].to(torch.int32))


def lora_add(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             token_slots: torch.Tensor, scalings: torch.Tensor) -> None:
    """In place: y[t] += scalings[s] * ((x[t] @ lora_a[s].T) @ lora_b[s].T) for every token t whose
    slot s = token_slots[t] >= 0; tokens with slot -1 are untouched.
    y [T, N] (a view whose last stride is 1: a column slice of a fused projection's output is allowed, so
    row stride may exceed N), x [T, K] (rows contiguous), lora_a [S, R, K], lora_b [S, N, R] (both x's dtype;
    a slot whose adapter has a smaller rank holds zeros beyond it), token_slots [T] int32 or int64,
    scalings [S] float32."""
    check_lora_shapes(y, x, lora_a, lora_b, token_slots, scalings)
    scale_dtype = torch.promote_types(x.dtype, torch.float32)  # fp32 for 16-bit x, as torch scales by a float
    for slot in torch.unique(token_slots).tolist():
        if slot < 0:
            continue
        rows = (token_slots == slot).nonzero().squeeze(1)
        shrunk = F.linear(x[rows], lora_a[slot])  # PEFT's lora_A: an nn.Linear without bias
        expanded = F.linear(shrunk, lora_b[slot])
        scaled = (expanded.to(scale_dtype) * scalings[slot]).to(x.dtype)
        y[rows] = y[rows] + scaled


def lora_add_fused(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   part_rows: tuple[int, ...], tokens: LoraTokens, scalings: torch.Tensor) -> None:
    """In place, for each part p of a fused projection: `lora_add` of y's columns [start_p, start_p + rows_p)
    (start_p the sum of the parts' rows before p) with A rows [p R, (p + 1) R) of lora_a [S, P*R, K] and B rows
    of those columns of lora_b [S, N, R], N = sum(part_rows) = y's width; `tokens.slots` as `lora_add`'s
    token_slots (the order by slot, which the Triton version reads, is not needed here)."""
    token_slots = tokens.slots
    check_fused_lora_shapes(y, x, lora_a, lora_b, part_rows, token_slots, scalings)
    rank = lora_b.shape[2]
    start = 0
    for part, rows in enumerate(part_rows):
        lora_add(y[:, start : start + rows], x, lora_a[:, part * rank : (part + 1) * rank],
                 lora_b[:, start : start + rows], token_slots, scalings)
        start += rows


def check_fused_lora_shapes(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                            part_rows: tuple[int, ...], token_slots: torch.Tensor, scalings: torch.Tensor) -> None:
    """ValueError unless the operands have the shapes `lora_add_fused`'s docstring states."""
    if not part_rows or sum(part_rows) != y.shape[1] or lora_a.shape[1] != len(part_rows) * lora_b.shape[2]:
        raise ValueError(f"parts of {list(part_rows)} rows do not fit y {tuple(y.shape)}, lora_a "
                         f"{tuple(lora_a.shape)} and lora_b {tuple(lora_b.shape)}: need N = the rows' sum and "
                         "lora_a's P*R rows")
    check_lora_shapes(y, x, lora_a[:, : lora_b.shape[2]], lora_b, token_slots, scalings)


def check_lora_shapes(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                      token_slots: torch.Tensor, scalings: torch.Tensor) -> None:
    """ValueError unless the operands have the shapes and dtypes `lora_add`'s docstring states."""
    num_tokens, k_size = x.shape
    num_slots, rank, a_k = lora_a.shape
    if y.dim() != 2 or y.shape[0] != num_tokens or y.stride(1) != 1:
        raise ValueError(f"y {tuple(y.shape)} (strides {y.stride()}) must be [{num_tokens}, N] with unit last stride")
    if a_k != k_size or tuple(lora_b.shape) != (num_slots, y.shape[1], rank):
        raise ValueError(f"lora_a {tuple(lora_a.shape)} / lora_b {tuple(lora_b.shape)} do not fit x "
                         f"{tuple(x.shape)} and y {tuple(y.shape)}: need [S, R, K] and [S, N, R]")
    if lora_a.dtype != x.dtype or lora_b.dtype != x.dtype:
        raise ValueError(f"adapter weights ({lora_a.dtype}, {lora_b.dtype}) must be in x's dtype {x.dtype}")
    if tuple(token_slots.shape) != (num_tokens,) or token_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token_slots must be int32 or int64 [{num_tokens}], got {token_slots.dtype} "
                         f"{tuple(token_slots.shape)}")
    if tuple(scalings.shape) != (num_slots,) or scalings.dtype != torch.float32:
        raise ValueError(f"scalings must be float32 [{num_slots}], got {scalings.dtype} {tuple(scalings.shape)}")
