"""Gumbel noise inside Triton kernels: the same draws as kernels/gumbel_ref.py (its docstring says why the
noise is keyed by (seed, position, vocab index) and how it is built), as jit helpers for the sampling kernels.

uint32 arithmetic wraps mod 2**32 natively here, so the hash is a few integer ops per entry; the transform
to noise is float32 with libdevice's log and log1p (accurate to about an ulp, and the functions torch's
float32 log/log1p call on a GPU). Not float64: its two logs would bound the temperature kernel by
arithmetic instead of memory.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def fmix32(x):
    x ^= x >> 16
    x *= 0x85EBCA6B
    x ^= x >> 13
    x *= 0xC2B2AE35
    x ^= x >> 16
    return x


@triton.jit
def _key_chain(start, w0, w1, w2, w3):
    key = fmix32(tl.full((), start, tl.uint32) ^ w0)
    key = fmix32(key ^ w1)
    key = fmix32(key ^ w2)
    return fmix32(key ^ w3)


@triton.jit
def row_keys(seed, position):
    """The row's two uint32 keys from its int64 seed and position (gumbel_ref.row_keys)."""
    w0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    w1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    w2 = (position & 0xFFFFFFFF).to(tl.uint32)
    w3 = ((position >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return _key_chain(0x9E3779B9, w0, w1, w2, w3), _key_chain(0x7F4A7C15, w0, w1, w2, w3)


@triton.jit
def uniform_of_index(key_a, key_b, index):
    """w in (0, 1), float32, from the hash of `index` under the row's keys."""
    bits = fmix32(key_a ^ index.to(tl.uint32))
    bits = fmix32(bits ^ key_b)
    w = (bits.to(tl.float32) + 0.5) * 2.3283064365386963e-10  # 2**-32
    return tl.minimum(w, 0.99999994)  # gumbel_ref.W_MAX


@triton.jit
def noise_of_uniform(w, LIBDEVICE: tl.constexpr):
    """The Gumbel noise of w (kernels/gumbel_ref.py's transform); the draw at an index is
    noise_of_uniform(uniform_of_index(key_a, key_b, index))."""
    return -accurate_log(-accurate_log1p(-w, LIBDEVICE), LIBDEVICE)


# libdevice's functions, or numpy's in the interpreter, which has no libdevice (`LIBDEVICE` = not
# interpreting: `kernels.triton_numerics.has_libdevice()`). tl.log and tl.exp alone would be the GPU's fast
# approximations, a few ulps away from torch's.
@triton.jit
def accurate_log(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.log(x)
    return tl.log(x)


@triton.jit
def accurate_log1p(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.log1p(x)
    # The interpreter exposes no log1p: Goldberg's correction of log(1 + x), within a few ulps of it.
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / (u - 1.0)))
