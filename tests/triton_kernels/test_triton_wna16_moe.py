"""The integer (W4A16 / W8A16) variant of the Triton fused MoE (kernels/triton_fused_moe.py, BITS) equals the
torch reference (kernels/fused_moe_ref.py on kernels/wna16_ref.py's PackedExperts), and the reference equals the
unquantized MoE on the dequantized experts: 4 and 8 bits, groups and per channel, with and without zero points,
batches of 1 to 70 tokens, experts that get no token, fp32 and bf16 (the interpreter's upcast)."""

from __future__ import annotations

import pytest
import torch

from kernels import fused_moe_ref, triton_fused_moe
from kernels.wna16_ref import PackedExperts, pack_rows


def packed_experts(num_experts: int, n_size: int, k_size: int, bits: int, group_size: int | None, asymmetric: bool,
                   dtype: torch.dtype, generator: torch.Generator) -> PackedExperts:
    """Random integers, small random scales and (asymmetric) zero points, in the canonical layout per expert."""
    group = group_size or k_size
    values = torch.randint(0, 2**bits, (num_experts, k_size, n_size), generator=generator)
    qweight = torch.stack([pack_rows(expert, bits) for expert in values])
    scales = (0.05 + 0.1 * torch.rand(num_experts, k_size // group, n_size, generator=generator)) / 2**bits
    zeros = torch.randint(0, 2**bits, scales.shape, generator=generator).to(dtype) if asymmetric else None
    return PackedExperts(qweight, scales.to(dtype), zeros, bits)


def case(num_tokens, num_experts, bits, group_size, asymmetric, dtype=torch.float32, seed=0, unused=(),
         hidden=64, inter=48):
    generator = torch.Generator().manual_seed(seed)
    hidden_states = torch.randn(num_tokens, hidden, generator=generator).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    logits[:, list(unused)] = -30.0  # never in any token's top k
    w13 = packed_experts(num_experts, 2 * inter, hidden, bits, group_size, asymmetric, dtype, generator)
    w2 = packed_experts(num_experts, hidden, inter, bits, group_size and 16, asymmetric, dtype, generator)
    return hidden_states, logits.to(dtype), w13, w2


@pytest.mark.parametrize("num_tokens", [1, 17, 70])
@pytest.mark.parametrize("bits, group_size, asymmetric", [(4, 32, True), (4, 64, False), (8, 32, True),
                                                          (4, None, True), (8, None, False)])
def test_integer_experts_match_the_reference_fp32(num_tokens, bits, group_size, asymmetric):
    hidden, logits, w13, w2 = case(num_tokens, 8, bits, group_size, asymmetric, unused=(0, 5))
    for renormalize in (True, False):
        want = fused_moe_ref.fused_moe(hidden, logits, w13, w2, 2, renormalize, False)
        got = triton_fused_moe.fused_moe(hidden, logits, w13, w2, 2, renormalize, False)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert want.abs().max() > 1e-3  # the experts did something


def test_the_integer_reference_is_the_float_reference_on_the_dequantized_experts():
    hidden, logits, w13, w2 = case(9, 4, 4, 32, True)
    dequantized = [torch.stack([w.dequantize(e) for e in range(4)]) for w in (w13, w2)]
    assert dequantized[0].shape == (4, 96, 64) and dequantized[1].shape == (4, 64, 48)
    got = fused_moe_ref.fused_moe(hidden, logits, w13, w2, 2, True, False)
    assert torch.equal(got, fused_moe_ref.fused_moe(hidden, logits, *dequantized, 2, True, False))


@pytest.mark.parametrize("round_routing_weights", [True, False], ids=["qwen3_moe", "mixtral"])
def test_integer_experts_round_where_the_reference_rounds_in_bf16(round_routing_weights):
    """bf16 activations and scales, fp32 arithmetic (UPCAST): W rounded to bf16 before the dot in both, so the
    kernel differs from the reference by accumulation order alone, far below bf16's error against fp32."""
    hidden, logits, w13, w2 = case(33, 8, 4, 32, True, dtype=torch.bfloat16, seed=1)
    want = fused_moe_ref.fused_moe(hidden, logits, w13, w2, 2, True, round_routing_weights)
    got = triton_fused_moe.fused_moe(hidden, logits, w13, w2, 2, True, round_routing_weights)
    fp32 = [PackedExperts(w.qweight, w.scales.float(), w.zeros.float(), w.bits) for w in (w13, w2)]
    reference32 = fused_moe_ref.fused_moe(hidden.float(), logits.float(), *fp32, 2, True, False)
    assert got.dtype == torch.bfloat16
    kernel_error = (got.float() - want.float()).norm() / want.float().norm()
    bf16_error = (want.float() - reference32).norm() / reference32.norm()
    assert kernel_error < 0.1 * bf16_error, (kernel_error, bf16_error)


def test_a_group_the_kernel_cannot_tile_is_refused():
    with pytest.raises(ValueError, match="group_size 24 is not a multiple of 16"):
        triton_fused_moe.integer_block_k(48, 24, 4)
    assert triton_fused_moe.integer_block_k(48, 16, 4) == 16 and triton_fused_moe.integer_block_k(48, 48, 8) == 32
