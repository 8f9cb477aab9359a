"""Batch-invariant Triton kernels (--batch-invariant, issue 21): a row's bits do not depend on the batch.

Each kernel computes a fixed set of rows once in one big batch and again embedded, at different positions,
among random rows in batches of 1, 3, 64 and 257; every row must be bitwise equal (torch.equal) across
them, and close to the torch reference. `assert_rows_batch_invariant` is shown to catch a kernel whose
reduction order depends on the batch size (a split-K linear), so these checks would fail on the
non-invariant paths they replace.

Under the interpreter a tile's `tl.dot` is summed in K order (conftest.py; numpy's matmul left it to the
host's BLAS, which failed these checks on some CPUs), so here they prove what each kernel feeds its tiles:
the same rows, K ranges and order whatever the batch. What the GPU's MMA does with a tile is checked on a
GPU by tests/gpu/test_batch_invariance_gpu.py, which runs the same bit checks on CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import fused_moe_ref, rmsnorm_ref, triton_fused_moe, triton_rotary, triton_silu_and_mul
from kernels.attention_metadata import AttentionMetadata
from kernels.batch_invariant_layer_ops import MOE_BLOCK_M, apply_row_by_row, batch_invariant_triton_layer_ops
from kernels.paged_attention_ref import paged_attention
from kernels.triton_backend import TritonAttentionBackend
from kernels.triton_batch_invariant_attention import BatchInvariantTritonBackend
from kernels.triton_batch_invariant_matmul import linear
from kernels.triton_batch_invariant_norm import BLOCK_V, gemma_rms_norm, log_softmax, rms_norm
from tests.triton_kernels.batch_invariance_cases import (
    BLOCK_SIZE,
    PagedPool,
    assert_rows_batch_invariant,
    others_of_random_lengths,
    random_tensor,
    ways_of_serving_one_sequence,
)

TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


# --- linear ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_through_the_tensor_memory_accelerator_gives_the_pointer_loads_bits(dtype, monkeypatch):
    """A tile with `tma` loads through tensor descriptors (zeros past every edge) and gives the bits of the same
    tile loaded by pointers, with a bias and N and K not multiples of the blocks; a tensor whose rows are not
    16-byte aligned (K = 75) takes the pointer loads."""
    from kernels import triton_batch_invariant_matmul as matmul

    launches = []
    kernel = matmul._batch_invariant_linear_kernel

    class CountedLaunches:  # the launches that load through tensor descriptors
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                if kwargs["TMA"]:
                    launches.append(grid)
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(matmul, "_batch_invariant_linear_kernel", CountedLaunches())
    for k_size, through_tma in ((104, True), (75, False)):
        hidden = random_tensor((37, k_size), dtype, 1)
        weight, bias = random_tensor((72, k_size), dtype, 2) * 0.1, random_tensor((72,), dtype, 3)
        assert matmul.tma_fits(hidden, weight) == through_tma
        launches.clear()
        loaded = linear(hidden, weight, bias, tile=matmul.TILE._replace(tma=True))
        assert len(launches) == through_tma
        assert torch.equal(loaded, linear(hidden, weight, bias, tile=matmul.TILE))
        expected = F.linear(hidden.float(), weight.float(), bias.float())
        torch.testing.assert_close(loaded.float(), expected, atol=TOLERANCE[dtype] * 4, rtol=TOLERANCE[dtype])


def test_linear_launches_the_same_tile_for_any_row_count_and_one_program_per_output_tile(monkeypatch):
    """What keeps a row's reduction order out of the batch's hands, seen in the launches: the same block sizes
    (TILE) for 1 to 257 rows, and a grid of one program per (row tile, column tile), none splitting K."""
    from kernels import triton_batch_invariant_matmul as matmul

    launches = []
    kernel = matmul._batch_invariant_linear_kernel

    class RecordedLaunches:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((grid, {name: kwargs[name] for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}))
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(matmul, "_batch_invariant_linear_kernel", RecordedLaunches())
    weight = random_tensor((72, 80), torch.float32, 2)
    for num_rows in (1, 3, 64, 257):
        launches.clear()
        linear(random_tensor((num_rows, 80), torch.float32, num_rows), weight)
        tiles = -(-num_rows // matmul.TILE.block_m) * -(-72 // matmul.TILE.block_n)
        assert launches == [((tiles,), {"BLOCK_M": matmul.TILE.block_m, "BLOCK_N": matmul.TILE.block_n,
                                        "BLOCK_K": matmul.TILE.block_k})], num_rows


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

HEAD_DIM = 64
SEQ_LEN = 70  # the sequence whose tokens are followed through every way of serving them
# Its tokens compared: every sixth, and each one beside a key tile's or segment's edge or a chunk's (29, 40).
POSITIONS = sorted(set(range(0, SEQ_LEN, 6)) | {15, 16, 28, 29, 31, 32, 40, 41, 47, 48, 63, 64, SEQ_LEN - 1})


# Segments of 32 to 64 keys, so that the 70-token sequence spans 2 or 3 of them (the default, 256, would be one).
ATTENTION_CASES = {
    "fp32-gqa4-segments32": (torch.float32, 4, {}, {"segment": 32}),
    "fp32-mha-window20-segments32": (torch.float32, 1, {"sliding_window": 20}, {"block_n": 16, "segment": 32}),
    "fp32-gqa6-softcap-tiles16-segments48": (torch.float32, 6, {"logit_softcap": 5.0}, {"block_n": 16, "segment": 48}),
    "bf16-gqa4-window40-softcap-segments64": (
        torch.bfloat16, 4, {"sliding_window": 40, "logit_softcap": 5.0}, {"segment": 64}),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_of_a_token_is_the_same_however_it_is_served(case):
    dtype, group_size, options, backend_options = ATTENTION_CASES[case]
    pool = PagedPool({"ours": SEQ_LEN, **others_of_random_lengths(7)}, group_size, dtype, seed=3)
    ways = ways_of_serving_one_sequence(pool, BatchInvariantTritonBackend(**backend_options), options, POSITIONS)
    whole = ways["whole prefill"]
    for way, output in ways.items():
        assert output.shape == whole.shape and not torch.isnan(output).any(), way
        assert torch.equal(output, whole), f"{way} differs from the whole prefill"
    metadata = pool.metadata([("ours", SEQ_LEN, SEQ_LEN)])
    expected = paged_attention(pool.queries["ours"], pool.kv_cache, metadata, HEAD_DIM ** -0.5, **options)
    torch.testing.assert_close(whole.float(), expected[POSITIONS].float(), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


SPLIT_CASES = {
    "fp32": (torch.float32, {}),
    "fp32-window40": (torch.float32, {"sliding_window": 40}),
    "bf16-softcap": (torch.bfloat16, {"logit_softcap": 5.0}),
}


@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_attention_decodes_split_over_segments_give_the_bits_of_one_program_merging_them(case):
    """Way (b) (each 32-key segment in programs of its own, a merge kernel) against way (a) (one program per
    decode folding and merging the segments in registers), for contexts of 1 to 4 segments, partial and whole:
    bitwise equal, and close to the torch reference."""
    dtype, options = SPLIT_CASES[case]
    seq_lens = {"one": 1, "under": 31, "exactly": 32, "over": 33, "two": 64, "three": 65, "four": 97}
    pool = PagedPool(seq_lens, 4, dtype, seed=5)
    steps = [(name, length, 1) for name, length in seq_lens.items()]
    split, in_registers = (torch.cat(pool.run(BatchInvariantTritonBackend(block_n=16, segment=32, split_decodes=way),
                                              steps, **options)) for way in (True, False))
    assert torch.equal(split, in_registers)
    metadata = pool.metadata(steps)
    query = torch.cat([pool.queries[name][-1:] for name in seq_lens])
    expected = paged_attention(query, pool.kv_cache, metadata, HEAD_DIM ** -0.5, **options)
    torch.testing.assert_close(split.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_attention_start_up_check_of_the_two_decode_ways(monkeypatch):
    """`segments_agree` (the worker splits decodes only where it holds) finds (a) and (b) equal here, and
    tells when they are not: (b) with other segments than (a)'s."""
    from kernels import triton_batch_invariant_attention as attention

    assert attention.segments_agree("cpu")

    class OtherSegmentsWhenSplit(BatchInvariantTritonBackend):
        def __init__(self, split_decodes):
            super().__init__(segment=128 if split_decodes else 256, split_decodes=split_decodes)

    monkeypatch.setattr(attention, "BatchInvariantTritonBackend", OtherSegmentsWhenSplit)
    assert not attention.segments_agree("cpu")


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
    # Into a given buffer (a piecewise CUDA graph's, worker_svc/mixed_graphs.py, whose bucket has tokens past
    # every sequence): the same rows, and the rows of tokens outside every sequence keep what they held.
    query = torch.cat([query, torch.randn(2, 8, HEAD_DIM)])
    buffer = torch.full_like(query, 7.0)
    returned = backend.paged_attention(query, pool.kv_cache, metadata, HEAD_DIM ** -0.5, output=buffer, **options)
    assert returned is buffer
    assert torch.equal(buffer[:-2], output)
    assert torch.equal(buffer[-2:], torch.full_like(buffer[-2:], 7.0))


def test_the_split_kv_decode_path_is_not_batch_invariant():
    """Why the backend above exists: kernels/triton_backend.py decodes through split-KV (and packs heads), so a
    token decoded gets other bits than the same token prefilled; the check above would fail on it."""
    pool = PagedPool({"ours": SEQ_LEN}, 4, torch.float32, seed=3)
    backend = TritonAttentionBackend(decode_kv_splits=4)
    whole = pool.run(backend, [("ours", SEQ_LEN, SEQ_LEN)])[0]
    decoded = torch.cat(pool.run(backend, [("ours", p + 1, 1) for p in range(SEQ_LEN)]))
    torch.testing.assert_close(decoded, whole, atol=1e-4, rtol=1e-4)
    assert not torch.equal(decoded, whole)


def test_the_prefill_kernel_with_a_window_is_not_chunking_invariant():
    """With a sliding window kernels/triton_prefill_attention.py starts its key tiles at the window start of a
    query tile's first row, which moves with the chunking: a prompt prefilled whole and in two chunks differs."""
    pool = PagedPool({"ours": SEQ_LEN}, 4, torch.float32, seed=3)
    backend, window = TritonAttentionBackend(), {"sliding_window": 20}
    whole = pool.run(backend, [("ours", SEQ_LEN, SEQ_LEN)], **window)[0]
    chunks = torch.cat([pool.run(backend, [("ours", 29, 29)], **window)[0],
                        pool.run(backend, [("ours", SEQ_LEN, SEQ_LEN - 29)], **window)[0]])
    torch.testing.assert_close(chunks, whole, atol=1e-4, rtol=1e-4)
    assert not torch.equal(chunks, whole)


# --- the LayerOps set -----------------------------------------------------------------------------------

@pytest.mark.parametrize("agree", [True, False])
def test_the_batch_invariant_layer_ops_set(monkeypatch, agree):
    from kernels import triton_batch_invariant_matmul as matmul

    monkeypatch.setattr(matmul, "tiles_agree", lambda device: agree)
    ops = batch_invariant_triton_layer_ops()
    assert ops.name == "triton-batch-invariant" and ops.batch_invariant
    # The tile follows the row count only where the device gives every tile the same bits.
    assert ops.linear.func is linear and ops.linear.keywords == {"tile": matmul.tile_by_rows if agree else matmul.TILE}
    assert ops.rms_norm is rms_norm and ops.gemma_rms_norm is gemma_rms_norm
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


def test_tiles_agree_compares_every_row_tile_with_the_tile(monkeypatch):
    """The start-up check: tiles that are all TILE agree; one that sums K in other groups does not under the
    interpreter (each BLOCK_K slice's dot is summed from zero, then added), which is why there it is TILE
    everywhere.
    tile_by_rows picks the first ROW_TILES entry that holds the rows."""
    from kernels import triton_batch_invariant_matmul as matmul

    monkeypatch.setattr(matmul, "ROW_TILES", ((8, matmul.TILE), (1 << 62, matmul.TILE)))
    assert matmul.tiles_agree("cpu")
    other = matmul.Tile(64, 64, 32, 4, 3)
    monkeypatch.setattr(matmul, "ROW_TILES", ((8, matmul.TILE), (64, other), (1 << 62, matmul.TILE)))
    assert not matmul.tiles_agree("cpu")
    assert [matmul.tile_by_rows(rows) for rows in (1, 8, 9, 64, 65)] == [matmul.TILE] * 2 + [other] * 2 + [matmul.TILE]


# --- sampling ---------------------------------------------------------------------------------------------

def test_the_triton_sampling_passes_are_batch_invariant_without_the_row_by_row_wrapper():
    """One program per row and a block fixed by the vocabulary: a row's token, max and normalizer (the
    first pass with Gumbel noise, then the nucleus draw) are the same bits in any batch, so the mode keeps
    the Triton set as it is instead of launching it once per row."""
    from kernels import sample_ref
    from kernels.sampling_ops import batch_invariant_sampling_ops, triton_sampling_ops

    ops = triton_sampling_ops()
    assert batch_invariant_sampling_ops(ops) is ops

    def first_and_nucleus(rows):
        n = rows.shape[0]
        temperature, seed = torch.full((n,), 0.8), torch.full((n,), 7, dtype=torch.int64)
        position, top_p, min_p = torch.full((n,), 5, dtype=torch.int64), torch.full((n,), 0.9), torch.zeros(n)
        ids, max_scaled, normalizer = ops.first_pass(rows, None, temperature, seed, position, 1e-5, True)
        threshold = sample_ref.kth_largest(rows, torch.full((n,), 50)).threshold
        ids = ops.nucleus(rows, ids, max_scaled, temperature, seed, position, top_p, min_p, threshold, 1e-5, None)
        return torch.stack([ids.double(), max_scaled.double(), normalizer.double()], dim=-1)

    assert_rows_batch_invariant(first_and_nucleus, random_tensor((64, 3000), torch.float32, 9) * 3,
                                batch_sizes=(1, 3, 64))


def test_steps_with_prefill_take_the_piecewise_graphs_in_batch_invariant_mode_too():
    """worker_svc/mixed_graphs.py captures a model's steps with prefill for either Triton attention backend (each
    writes into the graph's buffer), not for the torch reference, and not under tensor parallel."""
    from kernels.attention_backend import TorchReferenceBackend
    from worker_svc.mixed_graphs import supports_mixed_graphs

    model = torch.nn.Linear(2, 2)
    assert supports_mixed_graphs(model, 1, BatchInvariantTritonBackend())
    assert supports_mixed_graphs(model, 1, TritonAttentionBackend())
    assert not supports_mixed_graphs(model, 1, TorchReferenceBackend())
    assert not supports_mixed_graphs(model, 2, BatchInvariantTritonBackend())
