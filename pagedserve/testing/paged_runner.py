"""Test-side driver of a model through a paged KV cache: metadata from plain lists, and greedy decoding.

Why it exists: the attention reference tests and the model tests need the same bookkeeping (slot
mapping, block tables, per-step query lengths) that the worker's input builder does for real; this is the
obvious, loop-based version of it, kept in one place so both suites agree on the conventions.
"""

from __future__ import annotations

import random

import torch

from kernels.attention_metadata import AttentionMetadata


def build_metadata(
    block_tables: list[list[int]],
    seq_lens: list[int],
    query_lens: list[int],
    block_size: int,
    num_padding_tokens: int = 0,
) -> AttentionMetadata:
    """Metadata for sequences whose last `query_lens[i]` of `seq_lens[i]` context tokens are new now.

    Padding tokens (slot -1) are appended after the last sequence's tokens.
    """
    slots: list[int] = []
    for table, seq_len, query_len in zip(block_tables, seq_lens, query_lens):
        for position in range(seq_len - query_len, seq_len):
            slots.append(table[position // block_size] * block_size + position % block_size)
    slots.extend([-1] * num_padding_tokens)
    query_start_loc = [0]
    for query_len in query_lens:
        query_start_loc.append(query_start_loc[-1] + query_len)
    width = max(len(table) for table in block_tables)
    padded_tables = [table + [0] * (width - len(table)) for table in block_tables]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(padded_tables, dtype=torch.int32),
        block_size=block_size,
    )


def shuffled_block_tables(
    blocks_per_seq: list[int], num_blocks: int, rng: random.Random
) -> list[list[int]]:
    """Distinct, randomly ordered block ids for each sequence, drawn from a pool of `num_blocks`."""
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables = []
    for count in blocks_per_seq:
        tables.append(pool[:count])
        pool = pool[count:]
    return tables


def make_kv_caches(
    model_config, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32, num_kv_heads: int | None = None
) -> list[torch.Tensor]:
    """One NaN-filled `[2, num_blocks, block_size, Hkv, D]` cache per layer, so a stale read shows; Hkv is
    `num_kv_heads` (a tensor-parallel rank's share) or the model's."""
    heads = model_config.num_key_value_heads if num_kv_heads is None else num_kv_heads
    shape = (2, num_blocks, block_size, heads, model_config.head_dim)
    return [
        torch.full(shape, float("nan"), dtype=dtype)
        for _ in range(model_config.num_hidden_layers)
    ]


def greedy_generate_paged(
    model,
    model_config,
    prompts: list[list[int]],
    max_new_tokens: int,
    block_size: int = 16,
    prefill_chunk: int | None = None,
    seed: int = 0,
    num_kv_heads: int | None = None,
) -> list[list[int]]:
    """Greedy continuation of every prompt, all sequences batched together each step.

    Each step every sequence schedules its uncomputed tokens (at most `prefill_chunk` of them), so one
    batch mixes fresh prefill, chunked prefill and decode. Blocks are drawn shuffled from a shared pool.
    """
    rng = random.Random(seed)
    capacity = [-(-(len(p) + max_new_tokens) // block_size) for p in prompts]
    num_blocks = sum(capacity) + 3
    tables = shuffled_block_tables(capacity, num_blocks, rng)
    kv_caches = make_kv_caches(model_config, num_blocks, block_size, num_kv_heads=num_kv_heads)
    tokens = [list(p) for p in prompts]
    num_computed = [0] * len(prompts)
    generated: list[list[int]] = [[] for _ in prompts]
    while any(len(g) < max_new_tokens for g in generated):
        active = [i for i, g in enumerate(generated) if len(g) < max_new_tokens]
        query_lens = []
        input_ids: list[int] = []
        positions: list[int] = []
        for i in active:
            count = len(tokens[i]) - num_computed[i]
            if prefill_chunk is not None:
                count = min(count, prefill_chunk)
            input_ids += tokens[i][num_computed[i] : num_computed[i] + count]
            positions += range(num_computed[i], num_computed[i] + count)
            query_lens.append(count)
        seq_lens = [num_computed[i] + q for i, q in zip(active, query_lens)]
        metadata = build_metadata([tables[i] for i in active], seq_lens, query_lens, block_size)
        with torch.no_grad():
            hidden = model(
                torch.tensor(input_ids), torch.tensor(positions), kv_caches, metadata
            )
            last_rows = metadata.query_start_loc[1:].long() - 1
            next_ids = model.compute_logits(hidden[last_rows]).argmax(dim=-1).tolist()
        for i, query_len, next_id in zip(active, query_lens, next_ids):
            num_computed[i] += query_len
            if num_computed[i] == len(tokens[i]):
                tokens[i].append(next_id)
                generated[i].append(next_id)
    return generated


def prefill_logits_paged(
    model,
    model_config,
    prompts: list[list[int]],
    block_size: int = 16,
    seed: int = 0,
    kv_cache_dtype: torch.dtype = torch.float32,
    num_kv_heads: int | None = None,
) -> list[torch.Tensor]:
    """Logits `[len(prompt), vocab]` of every prompt, all prefilled in one flattened batch."""
    rng = random.Random(seed)
    capacity = [-(-len(p) // block_size) for p in prompts]
    num_blocks = sum(capacity) + 3
    tables = shuffled_block_tables(capacity, num_blocks, rng)
    kv_caches = make_kv_caches(model_config, num_blocks, block_size, kv_cache_dtype, num_kv_heads)
    lens = [len(p) for p in prompts]
    metadata = build_metadata(tables, lens, lens, block_size)
    input_ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([pos for p in prompts for pos in range(len(p))])
    with torch.no_grad():
        logits = model.compute_logits(model(input_ids, positions, kv_caches, metadata))
    return list(logits.split(lens))
