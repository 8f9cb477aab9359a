"""The CPU batch-invariant ops (kernels/batch_invariant_ref.py, the sampling wrapper): a row's result is
bitwise the same among 1, 3, 64 or 257 rows, and a token's attention output the same computed in a prefill,
in an extend over a cached prefix, or in a decode step; each close to the plain op it stands for."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import batch_invariant_ref as bi
from kernels import fused_moe_ref, paged_attention_ref, rmsnorm_ref, sample_ref
from kernels.attention_metadata import AttentionMetadata
from kernels.sampling_ops import batch_invariant_sampling_ops, torch_sampling_ops

BATCHES = (1, 3, 64, 257)


def _rows_agree(op, rows: torch.Tensor, *args) -> None:
    """Row 0 of `rows` through `op` among the first T rows, for each T: always the same bits."""
    alone = op(rows[:1], *args)
    alone = alone[0] if isinstance(alone, tuple) else alone
    for count in BATCHES[1:]:
        among = op(rows[:count], *args)
        among = among[0] if isinstance(among, tuple) else among
        assert torch.equal(among[:1], alone), f"row 0 differs among {count} rows"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_norms_and_activations_give_a_row_the_same_bits_in_any_batch(dtype):
    torch.manual_seed(0)
    rows = torch.randn(257, 128, dtype=dtype)
    weight, bias = torch.randn(192, 128, dtype=dtype), torch.randn(192, dtype=dtype)
    _rows_agree(bi.linear, rows, weight, bias)
    assert torch.allclose(bi.linear(rows, weight, bias).float(), F.linear(rows, weight, bias).float(),
                          rtol=2e-2, atol=2e-2)
    norm_weight = torch.rand(128, dtype=dtype) + 0.5
    ops = bi.batch_invariant_torch_layer_ops()
    _rows_agree(lambda x: ops.rms_norm(x, norm_weight, 1e-6, x * 0.5), rows)
    normed, residual = ops.rms_norm(rows, norm_weight, 1e-6, rows * 0.5)
    expected, expected_residual = rmsnorm_ref.rms_norm(rows, norm_weight, 1e-6, rows * 0.5)
    assert torch.equal(residual, expected_residual) and torch.allclose(normed.float(), expected.float(), atol=2e-2)
    _rows_agree(ops.silu_and_mul, rows)
    _rows_agree(lambda x: ops.gelu_and_mul(x, "tanh"), rows)
    _rows_agree(lambda x: ops.per_row(torch.tanh, x), rows)


def test_the_mixture_of_experts_gives_a_token_the_same_bits_whatever_else_is_routed():
    torch.manual_seed(1)
    hidden, router = torch.randn(257, 32), torch.randn(257, 8)
    w13, w2 = torch.randn(8, 2 * 48, 32) * 0.2, torch.randn(8, 32, 48) * 0.2
    _rows_agree(lambda h, r: bi.fused_moe(h, r[: h.shape[0]], w13, w2, 2, True, False), hidden, router)
    assert torch.allclose(bi.fused_moe(hidden, router, w13, w2, 2, True, False),
                          fused_moe_ref.fused_moe(hidden, router, w13, w2, 2, True, False), atol=1e-4)


def test_sampling_passes_give_a_row_the_same_token_and_logprobs_in_any_batch():
    torch.manual_seed(2)
    logits = torch.randn(257, 1000) * 3
    ops = batch_invariant_sampling_ops(torch_sampling_ops())
    count = logits.shape[0]
    temperature, seed = torch.full((count,), 0.8), torch.arange(count, dtype=torch.int64) + 7
    position, top_p, min_p = torch.full((count,), 5, dtype=torch.int64), torch.full((count,), 0.9), torch.zeros(count)

    def first_and_nucleus(rows):
        n = rows.shape[0]
        ids, max_scaled, normalizer = ops.first_pass(rows, None, temperature[:n], seed[:n], position[:n], 1e-5, True)
        threshold = sample_ref.kth_largest(rows, torch.full((n,), 50)).threshold
        ids = ops.nucleus(rows, ids, max_scaled, temperature[:n], seed[:n], position[:n], top_p[:n], min_p[:n],
                          threshold, 1e-5, None)
        return torch.stack([ids.double(), max_scaled.double(), normalizer.double()], dim=-1)

    _rows_agree(first_and_nucleus, logits)
    plain = sample_ref.first_pass(logits, None, temperature, seed, position, 1e-5, True)
    ours = ops.first_pass(logits, None, temperature, seed, position, 1e-5, True)
    assert torch.equal(plain[0], ours[0]) and torch.allclose(plain[2], ours[2])


def _paged(key: torch.Tensor, value: torch.Tensor, block: int = 4):
    """A cache holding one sequence's K/V [L, Hkv, D] in shuffled blocks, and its block table."""
    blocks = -(-key.shape[0] // block)
    cache = torch.zeros(2, blocks, block, key.shape[1], key.shape[2])
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    positions = torch.arange(key.shape[0])
    slots = table[positions // block].long() * block + positions % block
    paged_attention_ref.write_kv_cache(key, value, cache, slots)
    return cache, table


def _attend(query, cache, table, seq_len, block=4):
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(query.shape[0], dtype=torch.long),
        query_start_loc=torch.tensor([0, query.shape[0]], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32), block_tables=table.unsqueeze(0), block_size=block,
        num_decode_seqs=0)
    return bi.paged_attention(query, cache, metadata, 0.25, sliding_window=7)


def test_attention_gives_a_token_the_same_bits_in_a_prefill_an_extend_and_a_decode():
    torch.manual_seed(3)
    length = 23
    query, key, value = torch.randn(length, 4, 16), torch.randn(length, 2, 16), torch.randn(length, 2, 16)
    cache, table = _paged(key, value)
    prefill = _attend(query, cache, table, length)
    extend = _attend(query[15:], cache, table, length)  # the first 15 tokens' keys already cached
    decode = torch.cat([_attend(query[p : p + 1], cache, table, p + 1) for p in range(length)])
    assert torch.equal(extend, prefill[15:])
    assert torch.equal(decode, prefill)
    reference = paged_attention_ref.paged_attention(query, cache, AttentionMetadata(
        slot_mapping=torch.zeros(length, dtype=torch.long), query_start_loc=torch.tensor([0, length], dtype=torch.int32),
        seq_lens=torch.tensor([length], dtype=torch.int32), block_tables=table.unsqueeze(0), block_size=4,
        num_decode_seqs=0), 0.25, sliding_window=7)
    assert torch.allclose(prefill, reference, atol=1e-5)
