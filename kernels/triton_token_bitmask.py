"""The grammar mask as a Triton kernel (contract and torch reference: kernels/token_bitmask_ref.py).

Why a kernel: the reference expands the bitmask to a [M, V] boolean and scatters whole rows back (three
passes over M x V and two temporaries); here each program reads one block of a row's logits and the block's
32-bit words once, and writes -inf only where a bit is clear. Grid (M rows, ceil(V / BLOCK) blocks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, stride_logits, stride_bitmask, vocab_size,
                                num_words, BLOCK: tl.constexpr):
    index = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + index)
    tokens = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab_size
    words = tokens // 32
    has_word = in_vocab & (words < num_words)
    word = tl.load(bitmask_ptr + index * stride_bitmask + words, mask=has_word, other=0)
    allowed = ((word >> (tokens % 32).to(tl.int32)) & 1) != 0
    tl.store(logits_ptr + row * stride_logits + tokens, float("-inf"), mask=in_vocab & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, block: int = 1024) -> None:
    """Sets the logits of the tokens each row's bitmask disallows to -inf (in place)."""
    if rows.numel() == 0:
        return
    assert logits.stride(1) == 1 and bitmask.is_contiguous() and bitmask.dtype == torch.int32
    vocab_size = logits.shape[1]
    grid = (rows.shape[0], triton.cdiv(vocab_size, block))
    _apply_token_bitmask_kernel[grid](logits, bitmask, rows, logits.stride(0), bitmask.stride(0), vocab_size,
                                      bitmask.shape[1], BLOCK=block)
