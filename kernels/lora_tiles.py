"""How the batched multi-LoRA kernels (kernels/triton_lora.py) cut one call into programs: the tile sizes per token
count, chosen once from an H200 sweep, and the grid arithmetic that follows from them. Why a module of its own: these
are host-side choices (a function of the shapes alone, so a CUDA graph's bucket always runs the same kernels) that
the kernels, the sweep (benchmarks/lora_kernels_gpu.py) and the tests share, apart from the Triton code.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

DOT_BLOCK_M = 16  # tl.dot's least tile: the many-token path
# Up to this many tokens, the few-token path (`tiles_for`): at 16 tokens of 8 adapters the `tl.dot` path's tile
# runs its slots one after another (35-54 us per layer measured, against 7.5 us at one token); one token per program
# runs each token's adapter side by side.
FEW_TOKENS = 16
# The most fp32 values of a few-token program's product tile per thread (`fit_registers`), by tokens per program:
# compiled offline for sm_90 at P*R = 64, [1, 128, 64] at 2 warps (128 a thread) spilled nothing, [2, 64, 64] at 2
# warps (128) 35 local stores, at 4 warps (64) none, [1, 256, 64] at 2 warps (256) 138.
PRODUCT_ELEMENTS_PER_THREAD = {1: 128, 2: 64, 4: 64, 8: 64}
SHRINK_PROGRAMS = 128  # token tiles x K slices aimed at (about one per SM)
EXPAND_PROGRAMS = 512  # token tiles x column groups aimed at


@dataclass(frozen=True)
class LoraTiles:
    """How one `lora_add_fused` call is cut into programs; a function of the token count alone (`tiles_for`), so
    that a CUDA graph's bucket always runs the same kernels.

    Why two paths: at a decode step's 1-16 tokens the kernels are latency, not bytes (an 8B layer's adapters are
    0.3-0.9 MB; a call took ~7 us): what counts is how many dependent iterations a program runs and how many
    programs run side by side. `block_m` 16 runs one `tl.dot` per slot present in a 16-token tile (its least
    size); `block_m` 1, 2, 4 or 8 (the few-token path) multiplies and sums with `tl.sum` instead, each row with
    its own slot's weights (no loop over slots), and the expand sums all K slices' partials in one load.
    - `block_k`: K columns per shrink iteration; `split_columns`: the least K a shrink slice covers (a multiple
      of `block_k`), `max_splits` the most slices (so few tokens get up to `max_splits` programs of
      `split_columns / block_k` iterations each);
    - `block_n`: output columns per expand iteration;
    - `num_warps`, `num_stages`: both kernels' (a loop of one or two iterations gains nothing from stages);
    - `pdl`: programmatic dependent launch (Hopper): the expand is launched while the shrink runs, and its programs
      wait (griddepcontrol.wait) only before reading the partials, so the second launch's latency overlaps the
      first kernel. What the expand reads before the wait (the step's slots and order) was written before the
      shrink began, which waited for everything before it. Not in the interpreter (no grid dependency there)."""

    block_m: int = DOT_BLOCK_M
    block_k: int = 64
    split_columns: int = 512
    max_splits: int = 16
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    pdl: bool = False

    def __post_init__(self) -> None:
        powers = (self.block_m, self.block_k, self.block_n, self.max_splits, self.num_warps)
        if any(value < 1 or value & (value - 1) for value in powers) or self.block_m > DOT_BLOCK_M:
            raise ValueError(f"{self}: block_m (<= {DOT_BLOCK_M}), block_k, block_n, max_splits and num_warps "
                             "must be powers of two")
        if self.block_m == DOT_BLOCK_M and min(self.block_k, self.block_n) < 16:
            raise ValueError(f"{self}: tl.dot needs block_k and block_n of at least 16")
        if self.split_columns < self.block_k or self.split_columns % self.block_k or self.num_stages < 1:
            raise ValueError(f"{self}: split_columns must be a multiple of block_k, num_stages >= 1")


MANY_TOKEN_TILES = LoraTiles()
# (most tokens, tiles) in increasing order: a call of T tokens takes the first pair with T <= its bound; the last
# bound is FEW_TOKENS, more tokens take MANY_TOKEN_TILES. From the H200 sweep (`python -m benchmarks.lora_kernels_gpu
# --sweep`, Llama-3.1-8B's four fused layers at rank 16, summed; benchmarks/results/lora/h200_tile_sweep): one token
# per program throughout; at 1-2 tokens 64 K slices of one 64-column iteration each (22.8 us at 1 token against
# 32.5 us for the first guess, block_k 128 over 256-column slices at 2 warps); at 3-4 tokens 32 slices of one
# 128-column iteration (28.4 us); at 5-16 tokens 16 slices of one 256-column iteration, which also holds up with 8
# adapters in the 16 tokens (64.5 us, where the `tl.dot` path's 16-token tile walks its slots one after another:
# 205-322 us). A second sweep after the shrink's loads were vectorized (h200_tile_sweep/lora_sweep_after.json)
# found these within 1 us of the best at 1-4 tokens.
TILES_BY_TOKENS = (
    (2, LoraTiles(block_m=1, block_k=64, split_columns=64, max_splits=64, block_n=64, num_warps=4, num_stages=1)),
    (4, LoraTiles(block_m=1, block_k=128, split_columns=128, max_splits=32, block_n=64, num_warps=4, num_stages=1)),
    (FEW_TOKENS, LoraTiles(block_m=1, block_k=256, split_columns=256, max_splits=16, block_n=64, num_warps=4,
                           num_stages=1)),
)


def tiles_for(num_tokens: int) -> LoraTiles:
    """The tiles `lora_add_fused` uses for `num_tokens` tokens unless told others (TILES_BY_TOKENS)."""
    return next((tiles for most, tiles in TILES_BY_TOKENS if num_tokens <= most), MANY_TOKEN_TILES)


def fit_registers(tiles: LoraTiles, stacked_block: int) -> LoraTiles:
    """`tiles` with the few-token path's register tiles, [block_m, block_k, P*R] and [block_m, P*R, block_n]
    products and [splits, block_m, P*R] partials (P*R padded to `stacked_block`), cut to at most
    PRODUCT_ELEMENTS_PER_THREAD[block_m] values per thread (block_k, block_n and max_splits halved as needed);
    the `tl.dot` path's unchanged. Why: rank 16 keeps every tile the sweep tries, but a q|k|v of rank 64 (P*R =
    192, padded 256) would spill hundreds of registers to local memory on the same tiles."""
    if tiles.block_m == DOT_BLOCK_M:
        return tiles
    most = PRODUCT_ELEMENTS_PER_THREAD[tiles.block_m] * 32 * tiles.num_warps // (tiles.block_m * stacked_block)
    most = 1 << max(0, most.bit_length() - 1)  # a power of two
    return replace(tiles, block_k=min(tiles.block_k, most), block_n=min(tiles.block_n, most),
                   max_splits=min(tiles.max_splits, most))


def shrink_splits(num_tokens: int, k_size: int, tiles: LoraTiles) -> int:
    """K slices of the shrink for `num_tokens` tokens of width `k_size` (a function of the shapes alone): enough
    for about SHRINK_PROGRAMS programs, each slice at least `tiles.split_columns` wide."""
    wanted = max(1, SHRINK_PROGRAMS // _cdiv(num_tokens, tiles.block_m))
    return max(1, min(tiles.max_splits, k_size // tiles.split_columns, wanted))


def expand_columns(num_tokens: int, n_size: int, tiles: LoraTiles) -> int:
    """Output columns of one expand program (a multiple of `tiles.block_n`): about EXPAND_PROGRAMS programs, so
    that a wide output at many tokens does not re-read each token's partials once per block_n columns."""
    column_blocks = _cdiv(n_size, tiles.block_n)
    token_tiles = _cdiv(num_tokens, tiles.block_m)
    blocks_per_program = max(1, _cdiv(column_blocks * token_tiles, EXPAND_PROGRAMS))
    return blocks_per_program * tiles.block_n


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
