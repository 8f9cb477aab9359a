"""Batch-invariance checks shared by the interpreter tests (test_batch_invariant_kernels.py) and the GPU check
(gpu_batch_invariance_check.py): a row computed in different batches, a sequence served in different ways.

Why shared and device-agnostic: the interpreter runs tiny shapes and cannot show what only a GPU can get
wrong (tensor-core tiles, FMA contraction), so the same checks run on CUDA tensors at model-sized shapes.
No pytest import here.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.paged_attention_ref import write_kv_cache
from kernels.triton_backend import count_leading_decodes

BATCH_SIZES = (1, 3, 64, 257)
BLOCK_SIZE = 16


def random_tensor(shape, dtype, seed, device="cpu"):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def assert_rows_batch_invariant(fn, full: torch.Tensor, batch_sizes=BATCH_SIZES, seed=0):
    """fn(batch [T, ...]) -> [T, ...]: rows 0, 1, middle and last of `full` [R, ...] give the same bits in
    fn(full) and placed at random positions among random rows in a batch of T rows, for each T.
    Returns fn(full)."""
    generator = torch.Generator().manual_seed(seed)
    expected = fn(full)
    num_rows = full.shape[0]
    checked = sorted({0, 1, num_rows // 2, num_rows - 1})
    for batch_size in batch_sizes:
        for first in range(0, len(checked), batch_size):  # as many checked rows as fit, at random positions
            rows = checked[first: first + batch_size]
            positions = torch.randperm(batch_size, generator=generator)[: len(rows)].tolist()
            batch = torch.randn((batch_size,) + full.shape[1:], generator=generator).to(full.device, full.dtype)
            for row, position in zip(rows, positions):
                batch[position] = full[row]
            got = fn(batch)
            for row, position in zip(rows, positions):
                assert torch.equal(got[position], expected[row]), f"row {row} differs at batch size {batch_size}"
    return expected


class PagedPool:
    """K/V of several sequences cached through shuffled block tables in a NaN-filled pool, and each
    sequence's queries by position; `run` serves any mix of (sequence, seq_len, query_len) steps."""

    def __init__(self, seq_lens: dict[str, int], group_size: int, dtype: torch.dtype, seed: int,
                 num_kv_heads: int = 2, head_dim: int = 64, device="cpu"):
        generator = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        self.head_dim, self.device = head_dim, device
        names = list(seq_lens)
        blocks = [-(-seq_lens[name] // BLOCK_SIZE) for name in names]
        num_blocks = sum(blocks) + 2
        pool = list(range(num_blocks))
        rng.shuffle(pool)
        self.never_owned = pool[-1]
        self.tables, self.queries = {}, {}
        self.kv_cache = torch.full(
            (2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device
        )
        for name, count in zip(names, blocks):
            self.tables[name], pool = pool[:count], pool[count:]
            seq_len = seq_lens[name]
            keys = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).to(device, dtype)
            values = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).to(device, dtype)
            write_kv_cache(keys, values, self.kv_cache, self.slots(name, 0, seq_len))
            self.queries[name] = torch.randn(
                seq_len, num_kv_heads * group_size, head_dim, generator=generator
            ).to(device, dtype)

    def slots(self, name, start, end):
        table = self.tables[name]
        return torch.tensor(
            [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)], device=self.device
        )

    def metadata(self, steps, num_padding_tokens=0) -> AttentionMetadata:
        width = max(len(self.tables[name]) for name, _, _ in steps)
        starts = [0]
        for _, _, query_len in steps:
            starts.append(starts[-1] + query_len)
        partial = AttentionMetadata(
            slot_mapping=torch.cat([self.slots(name, s - q, s) for name, s, q in steps]
                                   + [torch.full((num_padding_tokens,), -1, device=self.device)]),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([s for _, s, _ in steps], dtype=torch.int32, device=self.device),
            block_tables=torch.tensor(
                [self.tables[n] + [self.never_owned] * (width - len(self.tables[n])) for n, _, _ in steps],
                dtype=torch.int32, device=self.device,
            ),
            block_size=BLOCK_SIZE,
        )
        return AttentionMetadata(**{**partial.__dict__, "num_decode_seqs": count_leading_decodes(partial)})

    def run(self, backend, steps, num_padding_tokens=2, **options):
        """Output rows of each step, in step order; the batch's padding tokens must come back as zeros."""
        metadata = self.metadata(steps, num_padding_tokens)
        query = torch.cat([self.queries[name][s - q: s] for name, s, q in steps])
        padding = torch.randn((num_padding_tokens,) + query.shape[1:]).to(self.device, query.dtype)
        query = torch.cat([query, padding])
        output = backend.paged_attention(query, self.kv_cache, metadata, self.head_dim ** -0.5, **options)
        padded = output[query.shape[0] - num_padding_tokens:]
        assert torch.equal(padded, torch.zeros_like(padded))
        starts = metadata.query_start_loc.tolist()
        return [output[starts[i]: starts[i + 1]] for i in range(len(steps))]


def others_of_random_lengths(seed, count=4, longest=90):
    rng = random.Random(seed)
    return {f"other{i}": rng.randint(1, longest) for i in range(count)}


def ways_of_serving_one_sequence(pool: PagedPool, backend, options,
                                 positions: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """The output rows [P, Hq, D] of sequence "ours" (L tokens) at `positions` (default: all L) served as a
    whole prefill, as two chunks (the second an extend over the cached first), as decodes one at a time and
    batched, and in mixed batches with the pool's other sequences (at least four of them). Fewer positions
    make the batch of decodes smaller (under the Triton interpreter it costs about a second a decode); the
    ones around the key tiles' edges are always decoded one at a time."""
    seq_len = pool.queries["ours"].shape[0]
    positions = list(range(seq_len)) if positions is None else sorted(positions)
    first_chunk, mixed_split = 29 * seq_len // 70, 40 * seq_len // 70
    others = [name for name in pool.queries if name != "ours"]
    other_lens = {name: pool.queries[name].shape[0] for name in others}

    def run(steps):
        return pool.run(backend, steps, **options)

    ways = {"whole prefill": run([("ours", seq_len, seq_len)])[0][positions]}
    ways["two chunks"] = torch.cat(
        [run([("ours", first_chunk, first_chunk)])[0], run([("ours", seq_len, seq_len - first_chunk)])[0]]
    )[positions]
    ways["decodes in one batch"] = torch.cat(run([("ours", p + 1, 1) for p in positions]))
    # One decode at a time for the positions around the key tiles' edges; the rest from the batch above.
    one_at_a_time = ways["decodes in one batch"].clone()
    for position in sorted({0, 15, 16, 31, 32, 63, 64, seq_len - 1} & set(positions)):
        one_at_a_time[positions.index(position)] = run([("ours", position + 1, 1)])[0][0]
    ways["decodes one at a time"] = one_at_a_time
    # Mixed batches: other sequences' decodes first, then chunks and prefills, ours among them.
    decodes = [(name, length, 1) for name, length in other_lens.items()]
    first = run(decodes[:2] + [(others[2], other_lens[others[2]], other_lens[others[2]]),
                               ("ours", mixed_split, mixed_split),
                               (others[3], other_lens[others[3]], max(other_lens[others[3]] // 3, 1))])[3]
    second = run(decodes + [("ours", mixed_split + 1, 1)])[-1]
    third = run(decodes[1:3] + [("ours", seq_len, seq_len - mixed_split - 1),
                                (others[0], other_lens[others[0]], 1)])[2]
    ways["mixed batches"] = torch.cat([first, second, third])[positions]
    return ways
