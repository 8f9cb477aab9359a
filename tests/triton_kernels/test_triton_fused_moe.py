"""The Triton fused MoE (kernels/triton_fused_moe.py) equals its torch reference (kernels/fused_moe_ref.py),
and the reference equals transformers' experts code: several expert counts, top-1 and top-2, batches of 1
to 70 tokens, experts that get no token, both routing-weight conventions, fp32 and bf16 (CPU interpreter);
float8 experts with per (expert, row) scales (the SCALED variant) too."""

from __future__ import annotations

import pytest
import torch

from kernels import fused_moe_ref, triton_fused_moe
from kernels.fp8_linear_ref import quantize_weight_per_channel
from kernels.moe_align import align_rows_to_experts


def moe_case(num_tokens, num_experts, hidden=64, inter=48, dtype=torch.float32, seed=0, unused_experts=()):
    generator = torch.Generator().manual_seed(seed)
    hidden_states = torch.randn(num_tokens, hidden, generator=generator).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    logits[:, list(unused_experts)] = -30.0  # never in any token's top k
    w13 = (0.2 * torch.randn(num_experts, 2 * inter, hidden, generator=generator)).to(dtype)
    w2 = (0.2 * torch.randn(num_experts, hidden, inter, generator=generator)).to(dtype)
    return hidden_states, logits.to(dtype), w13, w2


@pytest.mark.parametrize("num_tokens", [1, 5, 16, 17, 70])
@pytest.mark.parametrize("num_experts,top_k,unused", [(4, 1, ()), (4, 2, (1,)), (8, 2, (0, 5, 6)), (3, 2, ())])
def test_triton_fused_moe_matches_reference_fp32(num_tokens, num_experts, top_k, unused):
    case = moe_case(num_tokens, num_experts, unused_experts=unused)
    for renormalize in (True, False):
        want = fused_moe_ref.fused_moe(*case, top_k, renormalize, False)
        got = triton_fused_moe.fused_moe(*case, top_k, renormalize, False)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("round_routing_weights", [True, False], ids=["qwen3_moe", "mixtral"])
def test_triton_fused_moe_rounds_where_the_reference_rounds_in_bf16(round_routing_weights):
    """bf16 data, fp32 arithmetic (the interpreter's upcast): the same rounding points as the reference, so
    differences are the accumulation order of the products alone (an ulp here and there), far below bf16's
    error against fp32."""
    case = moe_case(33, 8, dtype=torch.bfloat16, seed=1)
    want = fused_moe_ref.fused_moe(*case, 2, True, round_routing_weights)
    got = triton_fused_moe.fused_moe(*case, 2, True, round_routing_weights)
    fp32 = fused_moe_ref.fused_moe(*(t.float() for t in case), 2, True, False)
    assert got.dtype == torch.bfloat16
    kernel_error = (got.float() - want.float()).norm() / want.float().norm()
    bf16_error = (want.float() - fp32).norm() / fp32.norm()
    assert kernel_error < 0.1 * bf16_error, (kernel_error, bf16_error)


def fp8_experts(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(float8 w13, float8 w2, w13_scale [E, 2I], w2_scale [E, H]): the experts quantized per (expert, row)."""
    (q13, s13), (q2, s2) = quantize_weight_per_channel(w13), quantize_weight_per_channel(w2)
    return q13, q2, s13, s2


@pytest.mark.parametrize("num_tokens", [1, 17, 70])
@pytest.mark.parametrize("num_experts,top_k,unused", [(4, 1, ()), (8, 2, (0, 5, 6))])
def test_triton_fused_moe_with_fp8_experts_matches_reference_fp32(num_tokens, num_experts, top_k, unused):
    """The scales multiply the fp32 sums in the kernel, the dequantized weights in the reference: the same
    products up to fp32 rounding. Scales far from 1 (the weights' amax / 448) would show a dropped one."""
    hidden, logits, w13, w2 = moe_case(num_tokens, num_experts, unused_experts=unused)
    q13, q2, s13, s2 = fp8_experts(w13, w2)
    for renormalize in (True, False):
        want = fused_moe_ref.fused_moe(hidden, logits, q13, q2, top_k, renormalize, False, s13, s2)
        got = triton_fused_moe.fused_moe(hidden, logits, q13, q2, top_k, renormalize, False, s13, s2)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("round_routing_weights", [True, False], ids=["qwen3_moe", "mixtral"])
def test_triton_fused_moe_with_fp8_experts_rounds_where_the_reference_rounds_in_bf16(round_routing_weights):
    """bf16 activations, float8 weights converted to bf16 in the kernel (exact), fp32 arithmetic under the
    interpreter: the kernel rounds where the reference does, so it is far closer to the reference than bf16 is to
    fp32 on the same float8 weights."""
    hidden, logits, w13, w2 = moe_case(33, 8, seed=1)
    q13, q2, s13, s2 = fp8_experts(w13, w2)
    bf16 = hidden.to(torch.bfloat16), logits.to(torch.bfloat16)
    want = fused_moe_ref.fused_moe(*bf16, q13, q2, 2, True, round_routing_weights, s13, s2)
    got = triton_fused_moe.fused_moe(*bf16, q13, q2, 2, True, round_routing_weights, s13, s2)
    fp32 = fused_moe_ref.fused_moe(*(t.float() for t in bf16), q13, q2, 2, True, False, s13, s2)
    assert got.dtype == torch.bfloat16
    kernel_error = (got.float() - want.float()).norm() / want.float().norm()
    bf16_error = (want.float() - fp32).norm() / fp32.norm()
    assert kernel_error < 0.1 * bf16_error, (kernel_error, bf16_error)


def test_alignment_pads_each_expert_to_the_tile_and_skips_unchosen_experts():
    expert_ids = torch.tensor([[2, 0], [2, 3], [0, 2]])  # expert 1 chosen by no token
    alignment = align_rows_to_experts(expert_ids, num_experts=4, block_m=4)
    rows = alignment.sorted_rows.view(-1, 4)
    used = alignment.tile_experts >= 0
    assert alignment.tile_experts[used].tolist() == [0, 2, 3]
    assert rows[used].tolist() == [[1, 4, 6, 6], [0, 2, 5, 6], [3, 6, 6, 6]]  # 6 = T * k: padding
    assert (rows[~used] == 6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("top_k,renormalize,round_weights", [(2, True, False), (2, False, True), (8, True, True),
                                                             (1, True, True)])
def test_reference_equals_transformers_experts(top_k, renormalize, round_weights, dtype):
    """kernels/fused_moe_ref.py against transformers' own MoE block (its default grouped_mm experts path), both
    routers: Mixtral's (renormalized, fp32 weights) and Qwen3-MoE's (norm_topk_prob, weights cast). In bf16
    bit for bit (measured: with the other family's weight convention 40% of the outputs differ)."""
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    common = dict(hidden_size=64, num_experts_per_tok=top_k, num_local_experts=8)
    if round_weights:
        config = Qwen3MoeConfig(moe_intermediate_size=48, norm_topk_prob=renormalize, **common)
        block_class = Qwen3MoeSparseMoeBlock
    else:
        config = MixtralConfig(intermediate_size=48, **common)
        block_class = MixtralSparseMoeBlock
    config._experts_implementation = "grouped_mm"
    hidden, _, w13, w2 = moe_case(19, 8, dtype=dtype)
    block = block_class(config).to(dtype)
    with torch.no_grad():
        block.gate.weight.normal_(0.0, 0.2)
        block.experts.gate_up_proj.copy_(w13)
        block.experts.down_proj.copy_(w2)
        want = block(hidden.unsqueeze(0))[0]
        router_logits = torch.nn.functional.linear(hidden, block.gate.weight)
        got = fused_moe_ref.fused_moe(hidden, router_logits, w13, w2, top_k, renormalize, round_weights)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
