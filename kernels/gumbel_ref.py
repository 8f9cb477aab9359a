"""Gumbel noise keyed by (seed, position, vocab index): the randomness of every sampled token.

Why keyed noise instead of a generator: the noise a row sees depends only on its own request's seed and the
position of the token being sampled, never on the batch around it, the row it landed in, or how many other
draws happened before. That makes a seeded request reproducible under continuous batching, and a recompute
after preemption draws the same tokens again. Gumbel-max turns the noise into a draw: the argmax over a kept
set of (logit / temperature + noise) is an exact sample from the softmax over that set, and the same noise
serves any kept set (top-k, top-p, min_p), so a kernel can look for the winner of a smaller set without
drawing again (kernels/triton_nucleus.py).

The generator: two 32-bit row keys are hash chains (murmur3's fmix32 finalizer) over the 32-bit words of
(seed, position); each vocab index is hashed under them with two more rounds. The 32 bits give w in (0, 1)
in float32, and the noise is -log(-log1p(-w)) in float32 (log1p keeps the large-noise tail, small w, exact
to the last bit: draws up to ~22.9 nats above the mean). The Triton kernels compute the same uint32 hash and
the same float32 ops with libdevice's log and log1p (kernels/triton_gumbel.py): on a GPU, torch's float32
log/log1p are the same CUDA math functions, so the bits agree; on the CPU they may differ in the last bit.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
_MASK16 = 0xFFFF
# Starting states of the two per-row key chains (any two distinct odd 32-bit values will do).
KEY_A_START = 0x9E3779B9
KEY_B_START = 0x7F4A7C15
# w = (bits + 0.5) * 2**-32 rounds to 1.0 for the top 128 hash values; the largest float32 below 1 keeps
# log1p(-w) finite (those draws get the smallest noise instead of -inf).
W_MAX = 0.99999994


def gumbel_noise(seed: torch.Tensor, position: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise float32 [N, vocab_size], a pure function of (seed[i], position[i], vocab index).

    seed, position: int64 [N] (the seed's 64 raw bits). All integer arithmetic is int64 holding values below
    2**32 (products stay below 2**49), so every op is well defined on every device.
    """
    key_a, key_b = row_keys(seed, position)
    vocab_ids = torch.arange(vocab_size, device=seed.device, dtype=torch.int64)
    bits = key_a.unsqueeze(-1) ^ vocab_ids.unsqueeze(0)
    _fmix32_(bits)
    bits ^= key_b.unsqueeze(-1)
    _fmix32_(bits)
    w = bits.to(torch.float32)
    del bits
    w.add_(0.5).mul_(2.0**-32).clamp_(max=W_MAX)
    return w.neg_().log1p_().neg_().log_().neg_()


def row_keys(seed: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent 32-bit keys per row, each a hash chain over the 32-bit words of (seed, position)."""
    words = (seed & MASK32, (seed >> 32) & MASK32, position & MASK32, (position >> 32) & MASK32)
    keys = []
    for start in (KEY_A_START, KEY_B_START):
        key = torch.full_like(seed, start)
        for word in words:
            key ^= word
            _fmix32_(key)
        keys.append(key)
    return keys[0], keys[1]


def _fmix32_(x: torch.Tensor) -> None:
    """murmur3's 32-bit finalizer, in place on int64 values in [0, 2**32): a bijection with full avalanche."""
    x ^= x >> 16
    _mul32_(x, 0x85EBCA6B)
    x ^= x >> 13
    _mul32_(x, 0xC2B2AE35)
    x ^= x >> 16


def _mul32_(x: torch.Tensor, constant: int) -> None:
    """x = x * constant mod 2**32, in place, for x in [0, 2**32), without any int64 overflow: the constant is
    split in 16-bit halves so each partial product stays below 2**48."""
    high = x * (constant >> 16)
    high &= _MASK16
    high <<= 16
    x *= constant & _MASK16
    x += high
    x &= MASK32
