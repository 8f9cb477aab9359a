"""Batch-invariant Triton kernels (--batch-invariant, issue 21): a row's bits do not depend on the batch.

Each kernel computes a fixed set of rows once in one big batch and again embedded, at different positions,
among random rows in batches of 1, 3, 64 and 257; every row must be bitwise equal (torch.equal) across
them, and close to the torch reference. `assert_rows_batch_invariant` is shown to catch a kernel whose
reduction order depends on the batch size (a split-K linear), so these checks would fail on the
non-invariant paths they replace.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kernels import fused_moe_ref, rmsnorm_ref, triton_fused_moe, triton_rotary, triton_silu_and_mul
from kernels.attention_metadata import AttentionMetadata
from kernels.batch_invariant_layer_ops import MOE_BLOCK_M, apply_row_by_row, batch_invariant_triton_layer_ops
from kernels.paged_attention_ref import paged_attention, write_kv_cache
from kernels.triton_backend import TritonAttentionBackend, count_leading_decodes
from kernels.triton_batch_invariant_attention import BatchInvariantTritonBackend
from kernels.triton_batch_invariant_matmul import linear
from kernels.triton_batch_invariant_norm import BLOCK_V, gemma_rms_norm, log_softmax, rms_norm

BATCH_SIZES = (1, 3, 64, 257)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def assert_rows_batch_invariant(fn, full: torch.Tensor, batch_sizes=BATCH_SIZES, seed=0):
    """fn(batch [T, ...]) -> [T, ...]: every checked row of `full` [R, ...] gives the same bits in fn(full)
    and when placed at some position of a batch of T random rows, for each T. Returns fn(full)."""
    generator = torch.Generator().manual_seed(seed)
    expected = fn(full)
    num_rows = full.shape[0]
    checked = sorted({0, 1, num_rows // 2, num_rows - 1})
    for batch_size in batch_sizes:
        for first in range(0, len(checked), batch_size):  # as many checked rows as fit, at random positions
            rows = checked[first: first + batch_size]
            positions = torch.randperm(batch_size, generator=generator)[: len(rows)].tolist()
            batch = torch.randn((batch_size,) + full.shape[1:], generator=generator).to(full.dtype)
            for row, position in zip(rows, positions):
                batch[position] = full[row]
            got = fn(batch)
            for row, position in zip(rows, positions):
                assert torch.equal(got[position], expected[row]), f"row {row} differs at batch size {batch_size}"
    return expected


def random_tensor(shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --- linear ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_linear_rows_are_batch_invariant_and_match_f_linear(dtype, with_bias):
    # K and N not multiples of the tiles (32, 64): a partial last K tile and a partial N tile.
    hidden = random_tensor((257, 80), dtype, 1)
    weight = random_tensor((72, 80), dtype, 2) * 0.1
    bias = random_tensor((72,), dtype, 3) if with_bias else None
    output = assert_rows_batch_invariant(lambda batch: linear(batch, weight, bias), hidden)
    assert output.dtype == dtype and output.shape == (257, 72)
    expected = F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())
    torch.testing.assert_close(output.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_linear_of_zero_rows():
    weight = random_tensor((8, 16), torch.float32, 0)
    assert linear(torch.empty(0, 16), weight).shape == (0, 8)


def test_linear_flattens_leading_axes_as_f_linear():
    hidden = random_tensor((2, 3, 16), torch.float32, 0)
    weight = random_tensor((8, 16), torch.float32, 1)
    torch.testing.assert_close(linear(hidden, weight), F.linear(hidden, weight), atol=1e-5, rtol=1e-5)


def test_the_invariance_check_catches_a_split_k_linear():
    """A linear that splits K in two for small batches (as a GEMM library's split-K path does) sums each row
    in another order there: the check must fail on it, or it proves nothing about `linear`."""
    weight = random_tensor((72, 80), torch.float32, 2)

    def split_k_for_small_batches(batch):
        if batch.shape[0] >= 64:
            return batch @ weight.T
        return batch[:, :40] @ weight[:, :40].T + batch[:, 40:] @ weight[:, 40:].T

    with pytest.raises(AssertionError, match="differs"):
        assert_rows_batch_invariant(split_k_for_small_batches, random_tensor((257, 80), torch.float32, 1))


# --- RMSNorm and log_softmax ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True], ids=["no_residual", "residual"])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_rms_norm_rows_are_batch_invariant_and_match_the_reference(dtype, with_residual, gemma):
    hidden_size = 96
    weight = random_tensor((hidden_size,), dtype, 4)
    kernel, reference = (gemma_rms_norm, rmsnorm_ref.gemma_rms_norm) if gemma else (rms_norm, rmsnorm_ref.rms_norm)

    def normed_and_residual(batch, norm=kernel):
        # batch [T, 2, H]: hidden and residual side by side, so one embedded row carries both.
        residual = batch[:, 1] if with_residual else None
        normed, new_residual = norm(batch[:, 0], weight, 1e-6, residual)
        return torch.stack([normed.to(batch.dtype), new_residual], dim=1)

    rows = random_tensor((257, 2, hidden_size), dtype, 5)
    output = assert_rows_batch_invariant(normed_and_residual, rows)
    expected = normed_and_residual(rows, norm=reference)
    torch.testing.assert_close(output.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_log_softmax_rows_are_batch_invariant_and_match_torch():
    # Three vocabulary chunks, the last one partial; in some rows a whole chunk is masked to -inf.
    vocab_size = 2 * BLOCK_V + 452
    logits = random_tensor((257, vocab_size), torch.float32, 6) * 4
    logits[::2, BLOCK_V: 2 * BLOCK_V] = float("-inf")
    output = assert_rows_batch_invariant(log_softmax, logits)
    expected = torch.log_softmax(logits, dim=-1)
    assert torch.equal(torch.isinf(output), torch.isinf(expected))
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's log(0) and inf - inf, the point of the test
def test_log_softmax_of_a_row_of_only_minus_infinity_is_nan_as_torch():
    logits = torch.full((2, 40), float("-inf"))
    logits[1] = 0.0
    output = log_softmax(logits)
    assert torch.isnan(output[0]).all()
    torch.testing.assert_close(output[1], torch.log_softmax(logits[1], dim=-1))


# --- attention ------------------------------------------------------------------------------------------

BLOCK_SIZE = 16
NUM_KV_HEADS = 2
HEAD_DIM = 64
SEQ_LEN = 70  # the sequence whose tokens are followed through every way of serving them
FIRST_CHUNK = 29


class PagedPool:
    """K/V of several sequences cached through shuffled block tables in a NaN-filled pool, and each
    sequence's queries by position; `run` serves any mix of (sequence, seq_len, query_len) steps."""

    def __init__(self, seq_lens: dict[str, int], group_size: int, dtype: torch.dtype, seed: int):
        generator = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        names = list(seq_lens)
        blocks = [-(-seq_lens[name] // BLOCK_SIZE) for name in names]
        num_blocks = sum(blocks) + 2
        pool = list(range(num_blocks))
        rng.shuffle(pool)
        self.never_owned = pool[-1]
        self.tables, self.queries = {}, {}
        self.kv_cache = torch.full((2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), float("nan"), dtype=dtype)
        for name, count in zip(names, blocks):
            self.tables[name], pool = pool[:count], pool[count:]
            seq_len = seq_lens[name]
            keys = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
            values = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
            write_kv_cache(keys, values, self.kv_cache, self.slots(name, 0, seq_len))
            self.queries[name] = torch.randn(
                seq_len, NUM_KV_HEADS * group_size, HEAD_DIM, generator=generator
            ).to(dtype)

    def slots(self, name, start, end):
        table = self.tables[name]
        return torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)])

    def metadata(self, steps, num_padding_tokens=0) -> AttentionMetadata:
        width = max(len(self.tables[name]) for name, _, _ in steps)
        starts = [0]
        for _, _, query_len in steps:
            starts.append(starts[-1] + query_len)
        partial = AttentionMetadata(
            slot_mapping=torch.cat([self.slots(name, s - q, s) for name, s, q in steps]
                                   + [torch.full((num_padding_tokens,), -1)]),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor([s for _, s, _ in steps], dtype=torch.int32),
            block_tables=torch.tensor(
                [self.tables[n] + [self.never_owned] * (width - len(self.tables[n])) for n, _, _ in steps],
                dtype=torch.int32,
            ),
            block_size=BLOCK_SIZE,
        )
        return AttentionMetadata(**{**partial.__dict__, "num_decode_seqs": count_leading_decodes(partial)})

    def run(self, backend, steps, num_padding_tokens=2, **options):
        """Output rows of each step, in step order; the batch's padding tokens must come back as zeros."""
        metadata = self.metadata(steps, num_padding_tokens)
        query = torch.cat([self.queries[name][s - q: s] for name, s, q in steps])
        query = torch.cat([query, torch.randn((num_padding_tokens,) + query.shape[1:]).to(query.dtype)])
        output = backend.paged_attention(query, self.kv_cache, metadata, HEAD_DIM ** -0.5, **options)
        assert torch.equal(output[query.shape[0] - num_padding_tokens:], torch.zeros_like(output[:num_padding_tokens]))
        starts = metadata.query_start_loc.tolist()
        return [output[starts[i]: starts[i + 1]] for i in range(len(steps))]


def others_of_random_lengths(seed, count=4):
    rng = random.Random(seed)
    return {f"other{i}": rng.randint(1, 90) for i in range(count)}


def ways_of_serving_one_sequence(pool: PagedPool, backend, options) -> dict[str, torch.Tensor]:
    """The output rows [SEQ_LEN, Hq, D] of sequence "ours" served as a whole prefill, as two chunks (the second
    an extend over the cached first), as decodes one at a time and batched, and inside mixed batches."""
    others = [name for name in pool.queries if name != "ours"]
    other_lens = {name: pool.queries[name].shape[0] for name in others}

    def run(steps):
        return pool.run(backend, steps, **options)

    ways = {"whole prefill": run([("ours", SEQ_LEN, SEQ_LEN)])[0]}
    ways["two chunks"] = torch.cat(
        [run([("ours", FIRST_CHUNK, FIRST_CHUNK)])[0], run([("ours", SEQ_LEN, SEQ_LEN - FIRST_CHUNK)])[0]]
    )
    ways["decodes in one batch"] = torch.cat(run([("ours", p + 1, 1) for p in range(SEQ_LEN)]))
    # One decode at a time for the positions around the key tiles' edges; the rest from the batch above.
    one_at_a_time = ways["decodes in one batch"].clone()
    for position in (0, 15, 16, 31, 32, 63, 64, SEQ_LEN - 1):
        one_at_a_time[position] = run([("ours", position + 1, 1)])[0][0]
    ways["decodes one at a time"] = one_at_a_time
    # Mixed batches: other sequences' decodes first, then chunks and prefills, ours among them.
    decodes = [(name, length, 1) for name, length in other_lens.items()]
    first = run(decodes[:2] + [(others[2], other_lens[others[2]], other_lens[others[2]]), ("ours", 40, 40),
                               (others[3], other_lens[others[3]], max(other_lens[others[3]] // 3, 1))])[3]
    second = run(decodes + [("ours", 41, 1)])[-1]
    third = run(decodes[1:3] + [("ours", SEQ_LEN, SEQ_LEN - 41), (others[0], other_lens[others[0]], 1)])[2]
    ways["mixed batches"] = torch.cat([first, second, third])
    return ways


ATTENTION_CASES = {
    "fp32-gqa4": (torch.float32, 4, {}, {}),
    "fp32-mha-window20": (torch.float32, 1, {"sliding_window": 20}, {}),
    "fp32-gqa4-softcap-tiles16": (torch.float32, 4, {"logit_softcap": 5.0}, {"block_n": 16}),
    "bf16-gqa4-window40-softcap": (torch.bfloat16, 4, {"sliding_window": 40, "logit_softcap": 5.0}, {}),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_of_a_token_is_the_same_however_it_is_served(case):
    dtype, group_size, options, backend_options = ATTENTION_CASES[case]
    pool = PagedPool({"ours": SEQ_LEN, **others_of_random_lengths(7)}, group_size, dtype, seed=3)
    ways = ways_of_serving_one_sequence(pool, BatchInvariantTritonBackend(**backend_options), options)
    whole = ways["whole prefill"]
    for way, output in ways.items():
        assert output.shape == whole.shape and not torch.isnan(output).any(), way
        assert torch.equal(output, whole), f"{way} differs from the whole prefill"
    metadata = pool.metadata([("ours", SEQ_LEN, SEQ_LEN)])
    expected = paged_attention(pool.queries["ours"], pool.kv_cache, metadata, HEAD_DIM ** -0.5, **options)
    torch.testing.assert_close(whole.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_padding_sequences_of_a_cuda_graph_bucket_give_zeros_and_change_no_other_row():
    """A decode bucket is padded with sequences of context 0 and one padding token each (slot -1)."""
    pool = PagedPool({"ours": SEQ_LEN, **others_of_random_lengths(7)}, 4, torch.float32, seed=3)
    backend = BatchInvariantTritonBackend()
    options = {"sliding_window": 20}
    whole = pool.run(backend, [("ours", SEQ_LEN, SEQ_LEN)], **options)[0]
    steps = [("ours", 41, 1), ("other0", pool.queries["other0"].shape[0], 1)]
    unpadded = pool.metadata(steps)
    num_padding = 3
    metadata = AttentionMetadata(
        slot_mapping=torch.cat([unpadded.slot_mapping, torch.full((num_padding,), -1)]),
        query_start_loc=torch.cat([unpadded.query_start_loc, torch.arange(1, num_padding + 1, dtype=torch.int32) + 2]),
        seq_lens=torch.cat([unpadded.seq_lens, torch.zeros(num_padding, dtype=torch.int32)]),
        block_tables=torch.cat([unpadded.block_tables, torch.full((num_padding, unpadded.block_tables.shape[1]),
                                                                  pool.never_owned, dtype=torch.int32)]),
        block_size=BLOCK_SIZE,
        num_decode_seqs=len(steps) + num_padding,
    )
    query = torch.cat([pool.queries["ours"][40:41], pool.queries["other0"][-1:], torch.randn(num_padding, 8, HEAD_DIM)])
    output = backend.paged_attention(query, pool.kv_cache, metadata, HEAD_DIM ** -0.5, **options)
    assert torch.equal(output[0], whole[40])
    assert torch.equal(output[2:], torch.zeros_like(output[2:]))


def test_the_split_kv_decode_path_is_not_batch_invariant():
    """Why the backend above exists: kernels/triton_backend.py decodes through split-KV (and packs heads), so a
    token decoded gets other bits than the same token prefilled; the check above would fail on it."""
    pool = PagedPool({"ours": SEQ_LEN}, 4, torch.float32, seed=3)
    backend = TritonAttentionBackend(decode_kv_splits=4)
    whole = pool.run(backend, [("ours", SEQ_LEN, SEQ_LEN)])[0]
    decoded = torch.cat(pool.run(backend, [("ours", p + 1, 1) for p in range(SEQ_LEN)]))
    torch.testing.assert_close(decoded, whole, atol=1e-4, rtol=1e-4)
    assert not torch.equal(decoded, whole)


# --- the LayerOps set -----------------------------------------------------------------------------------

def test_the_batch_invariant_layer_ops_set():
    ops = batch_invariant_triton_layer_ops()
    assert ops.name == "triton-batch-invariant" and ops.batch_invariant
    assert ops.linear is linear and ops.rms_norm is rms_norm and ops.gemma_rms_norm is gemma_rms_norm
    assert ops.rotary_embedding is triton_rotary.rotary_embedding
    assert ops.silu_and_mul is triton_silu_and_mul.silu_and_mul
    assert ops.gelu_and_mul is triton_silu_and_mul.gelu_and_mul
    assert ops.fused_moe.func is triton_fused_moe.fused_moe and ops.fused_moe.keywords == {"block_m": MOE_BLOCK_M}
    assert ops.per_row is apply_row_by_row


def test_per_row_applies_the_function_one_row_at_a_time():
    seen = []

    def soft_cap(rows):
        seen.append(rows.shape)
        return torch.tanh(rows / 30.0) * 30.0

    logits = random_tensor((5, 33), torch.float32, 8) * 50
    torch.testing.assert_close(apply_row_by_row(soft_cap, logits), torch.tanh(logits / 30.0) * 30.0)
    assert seen == [(1, 33)] * 5
    assert apply_row_by_row(soft_cap, logits[:0]).shape == (0, 33)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_with_its_fixed_tile_is_batch_invariant(dtype):
    """By default the MoE's row tile is 16 rows for T <= E and 64 above (`tile_rows`); the batch-invariant set
    fixes it. Rows (hidden | router logits side by side) through T = 1, 3, 64, 257 with 4 experts, top 2."""
    hidden_size, inter, num_experts = 32, 24, 4
    w13 = random_tensor((num_experts, 2 * inter, hidden_size), dtype, 9) * 0.2
    w2 = random_tensor((num_experts, hidden_size, inter), dtype, 10) * 0.2
    fused_moe = batch_invariant_triton_layer_ops().fused_moe

    def moe(batch, fn=fused_moe):
        return fn(batch[:, :hidden_size].contiguous(), batch[:, hidden_size:].contiguous(), w13, w2, 2, True, False)

    rows = random_tensor((257, hidden_size + num_experts), dtype, 11)
    output = assert_rows_batch_invariant(moe, rows)
    expected = moe(rows, fn=fused_moe_ref.fused_moe)
    torch.testing.assert_close(output.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
