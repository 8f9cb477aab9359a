"""Batch-invariant row reductions in Triton: RMSNorm (Llama's and Gemma's) and log-softmax over the vocabulary.

Torch references: kernels/rmsnorm_ref.py (`rms_norm`, `gemma_rms_norm`) and `torch.log_softmax` in fp32.

Why: a row's reduction (sum of squares, max, sum of exponentials) must be taken in an order that depends on
that row's length only, never on how many rows the batch has (--batch-invariant). torch's
reductions choose their kernel (and a split of a long row over several blocks) from the whole tensor's
shape, so the same row can be summed in another order in another batch.

RMSNorm: the existing kernels in kernels/triton_rmsnorm.py already have this property, so they are reused,
not copied: one program per token, the whole row in one BLOCK = next_power_of_2(H) tile (`num_warps` a
function of BLOCK too), summed by one `tl.sum` whose tree is fixed by (BLOCK, num_warps); T only sizes the
grid. The residual add and the casts are elementwise.

log_softmax: one program per row, the vocabulary walked from 0 in fixed `BLOCK_V` chunks, twice: an online
max and sum of exponentials (the sum rescaled when the max grows, as flash attention does), then the writes
`x - max - log(sum)`. A chunk whose logits are all -inf (a masked vocabulary tail) leaves the state
exactly as it was (the max is guarded, as in kernels/triton_paged_kv.py, so no NaN appears); a row of only
-inf gives NaN, as torch does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_rmsnorm import gemma_rms_norm, rms_norm

__all__ = ["rms_norm", "gemma_rms_norm", "log_softmax", "BLOCK_V"]

BLOCK_V = 1024  # the one vocabulary chunk; a constant so that every row is summed in the same chunks


@triton.jit(do_not_specialize=["vocab_size"])
def _log_softmax_kernel(logits_ptr, out_ptr, vocab_size, stride_logits, stride_out, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    row_logits = logits_ptr + row * stride_logits
    running_max = tl.full([1], float("-inf"), tl.float32)
    running_sum = tl.zeros([1], tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        mask = start + cols < vocab_size
        chunk = tl.load(row_logits + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(chunk, 0))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        running_sum = running_sum * tl.exp(running_max - safe_max) + tl.sum(tl.exp(chunk - safe_max), 0)
        running_max = new_max
    log_normalizer = running_max + tl.log(running_sum)
    for start in range(0, vocab_size, BLOCK_V):
        mask = start + cols < vocab_size
        chunk = tl.load(row_logits + start + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + start + cols, chunk - log_normalizer, mask=mask)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last axis of fp32 logits [N, V] -> fp32 [N, V]; row i's bits depend only on row i."""
    assert logits.dim() == 2 and logits.dtype == torch.float32
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    num_rows, vocab_size = logits.shape
    out = torch.empty_like(logits)
    if num_rows == 0 or vocab_size == 0:
        return out
    _log_softmax_kernel[(num_rows,)](
        logits, out, vocab_size, logits.stride(0), out.stride(0), BLOCK_V=BLOCK_V, num_warps=4,
    )
    return out
