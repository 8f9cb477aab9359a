"""Paged-attention test cases: random K/V cached through shuffled block tables in a NaN-filled pool.

Why NaN: blocks a sequence does not own, slots past its context in its last block, and the block-table
padding entries (pointed at a never-owned block) all hold NaN, so a kernel that reads a wrong slot
produces NaN instead of a plausible number. Shared by the interpreter tests (tests/triton_kernels/) and by the GPU
check in benchmarks/kernel_bench.py (no pytest import here).
"""

from __future__ import annotations

import random

import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.paged_attention_ref import write_kv_cache
from kernels.triton_backend import count_leading_decodes
from pagedserve.testing.paged_runner import build_metadata, shuffled_block_tables

BLOCK_SIZE = 16
NUM_KV_HEADS = 2

# (context length after the step, new tokens this step). Decodes first, as the input builder orders them.
DECODES = [(1, 1), (15, 1), (16, 1), (17, 1), (45, 1), (300, 1)]
MIXED_DECODES = [(1, 1), (16, 1), (17, 1), (150, 1)]
# Fresh prefills (q == context; one of length 1 in the prefill range), chunked prefills and prefix hits.
MIXED_PREFILLS = [(15, 15), (1, 1), (70, 70), (40, 9), (100, 31), (33, 17), (16, 16), (17, 17), (80, 3)]
MIXED = MIXED_DECODES + MIXED_PREFILLS

# Sliding window and soft-capping. Windows of 1, under, at and over the block size (16) and the tiles
# (decode 64 keys, prefill 32), and one longer than most contexts; split-KV segments then cut the window.
WINDOWS = [1, 7, 16, 40, 200]
WINDOW_DECODES = [(1, 1), (15, 1), (16, 1), (17, 1), (45, 1), (300, 1)]
# Fresh prefills, and chunks over a cached prefix whose windows start inside it: (100, 31) has rows whose
# window starts at keys 30..60 (W 40), (300, 70) runs every stretch of the prefill's window loop (W 200).
WINDOW_PREFILLS = [(15, 15), (70, 70), (40, 9), (100, 31), (300, 70), (80, 3), (17, 17)]


def make_case(cases, group_size, head_dim, dtype, num_padding_tokens=0, seed=0, device="cpu"):
    """(query, kv_cache, metadata) with each context's old part cached and its new part written.

    `metadata.num_decode_seqs` counts the leading query-length-1 sequences.
    """
    generator = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_per_seq = [-(-seq_len // BLOCK_SIZE) for seq_len, _ in cases]
    num_blocks = sum(blocks_per_seq) + 3
    tables = shuffled_block_tables(blocks_per_seq, num_blocks, rng)
    never_owned = next(b for b in range(num_blocks) if all(b not in t for t in tables))
    kv_cache = torch.full((2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_dim), float("nan"), dtype=dtype)
    seq_lens = [seq_len for seq_len, _ in cases]
    query_lens = [query_len for _, query_len in cases]
    everything = build_metadata(tables, seq_lens, seq_lens, BLOCK_SIZE)
    keys = torch.randn(len(everything.slot_mapping), NUM_KV_HEADS, head_dim, generator=generator)
    values = torch.randn(keys.shape, generator=generator)
    write_kv_cache(keys.to(dtype), values.to(dtype), kv_cache, everything.slot_mapping)
    metadata = build_metadata(tables, seq_lens, query_lens, BLOCK_SIZE, num_padding_tokens)
    width = metadata.block_tables.shape[1]
    padded_tables = torch.tensor([t + [never_owned] * (width - len(t)) for t in tables], dtype=torch.int32)
    query = torch.randn(
        len(metadata.slot_mapping), NUM_KV_HEADS * group_size, head_dim, generator=generator
    ).to(dtype)
    metadata = AttentionMetadata(
        slot_mapping=metadata.slot_mapping.to(device),
        query_start_loc=metadata.query_start_loc.to(device),
        seq_lens=metadata.seq_lens.to(device),
        block_tables=padded_tables.to(device),
        block_size=BLOCK_SIZE,
        num_decode_seqs=count_leading_decodes(metadata),
    )
    return query.to(device), kv_cache.to(device), metadata


def poison_keys_before_windows(kv_cache, metadata, window):
    """NaN into K and V of every position before the window of its sequence's first new token, which no
    tile may read: a kernel that loops from key 0 (not from the window's start) returns NaN."""
    poisoned = kv_cache.clone()
    query_lens = metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]
    for table, seq_len, query_len in zip(metadata.block_tables, metadata.seq_lens, query_lens):
        first_visible = int(seq_len - query_len) - window + 1
        for position in range(max(first_visible, 0)):
            poisoned[:, table[position // BLOCK_SIZE], position % BLOCK_SIZE] = float("nan")
    return poisoned
