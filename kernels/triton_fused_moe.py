"""Fused mixture-of-experts MLP in Triton: routing and alignment in torch on the device, two grouped GEMMs.

Torch reference: kernels/fused_moe_ref.py (`fused_moe`), same contract and rounding points.

Steps (as vLLM's fused_moe): the reference's `select_experts` (softmax, top-k, renormalize: a few tiny
ops); `align_rows_to_experts` (kernels/moe_align.py) sorts the T * k (token, choice) rows by expert, padded
per expert to BLOCK_M; a grouped GEMM over (tile, N tile) programs computes every chosen row's gate|up with
its expert's w13; the SiLU-and-mul kernel; the same grouped GEMM with w2 and the routing weight applied;
the sum over the k choices in fp32. Only the experts some token chose are read, each once per tile of its
rows: a decode step reads the chosen experts' weights and no others.

The GEMM rounds its fp32 accumulator to the activation dtype (HF's linear output), then, with
MUL_ROUTED_WEIGHT, multiplies by the routing weight in fp32 and stores in the output's dtype: the activation
dtype when the weights were rounded (Qwen3-MoE, one more rounding), fp32 otherwise (Mixtral). Every size is
a function of (T, k, E, the tile sizes), no value is read back to the host: it runs under CUDA graphs.

FP8 experts (weight-only, the SCALED variant): the GEMM loads float8_e4m3fn weight tiles (half the bytes of
bf16: decode's weight reads are what a MoE decode step costs) and converts them to the activation dtype,
which holds every float8 value exactly; the product accumulates in fp32 as above, and the accumulator's
columns are multiplied by their rows' scales (w13_scale [E, 2I], w2_scale [E, H], fp32) before the rounding
to the activation dtype: the reference's dequantize-then-multiply up to fp32 rounding.

Integer experts (weight-only W4A16 / W8A16, the BITS variant; kernels/wna16_ref.py's PackedExperts): the GEMM
loads the expert's packed int32 words [K // pack, N] (an eighth of bf16's bytes at 4 bits), unpacks and
dequantizes them in registers per group in fp32 (kernels/triton_wna16_gemm.py's `dequantize_tile`), rounds W to
the activation dtype and feeds tl.dot with an fp32 accumulator: the reference's rounding points. BLOCK_K is
fitted to divide the group (`integer_block_k`), so each step reads one scale (and zero) row. Triton converts
float8_e4m3fn ("fp8e4nv") only on compute capability 8.9 and up; the loader refuses FP8 experts below that.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fused_moe_ref import select_experts, weighted_sum_over_choices
from kernels.moe_align import ExpertAlignment, align_rows_to_experts
from kernels.triton_numerics import dot_precision, needs_upcast
from kernels.triton_silu_and_mul import silu_and_mul
from kernels.triton_wna16_gemm import SMALLEST_BLOCK_K, dequantize_tile
from kernels.wna16_ref import PackedExperts

BLOCK_N, BLOCK_K = 64, 32


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, scales_ptr, zeros_ptr, sorted_rows_ptr, tile_experts_ptr,
    num_rows, n_size, k_size, a_rows_per_input, group_size,
    stride_a, stride_be, stride_bn, stride_bk, stride_c, stride_se, stride_sg, stride_ze, stride_zg,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr, SCALED: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """c[row, n] = (a[row // a_rows_per_input] . b[expert(row), n]) (* scales[expert(row), n]) (* weights[row])
    for the rows of one tile; SCALED: b is float8, converted to a's dtype as it is loaded; BITS (nonzero): b is
    the expert's packed int32 [K // pack, N], dequantized per group in fp32 and rounded to a's dtype."""
    tile = tl.program_id(0)
    expert = tl.load(tile_experts_ptr + tile).to(tl.int64)
    if expert < 0:
        return
    rows = tl.load(sorted_rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = rows < num_rows
    rows = tl.where(row_mask, rows, 0)
    a_rows = rows // a_rows_per_input
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_size
    b_base = b_ptr + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, k_size, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_mask = ks < k_size
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        if BITS:  # BLOCK_K sits inside one group (the wrapper fits it): one scale and zero row per step
            packed = tl.load(b_base + (ks // (32 // BITS)).to(tl.int64)[:, None] * stride_bk,
                             mask=k_mask[:, None] & col_mask[None, :], other=0)
            group = (k_start // group_size).to(tl.int64)
            b = dequantize_tile(packed, (ks % (32 // BITS)) * BITS, scales_ptr + expert * stride_se + group * stride_sg,
                                zeros_ptr + expert * stride_ze + group * stride_zg, cols, col_mask, BITS, HAS_ZEROS)
            b = b.to(a_ptr.dtype.element_ty)  # W rounded to the activation dtype, as the reference
        else:
            b = tl.load(b_base + ks[:, None] * stride_bk, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
        b = b.to(a.dtype)  # float8 -> the activation dtype (exact); 16-bit -> fp32 under UPCAST; else as it is
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    if SCALED:  # each output column is one weight row: its scale, on the fp32 sum
        acc = acc * tl.load(scales_ptr + expert * stride_se + cols, mask=col_mask, other=0.0)[None, :]
    result = acc.to(a_ptr.dtype.element_ty).to(tl.float32)  # the linear's output, rounded as HF's
    if MUL_ROUTED_WEIGHT:
        result = result * tl.load(weights_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    c = c_ptr + rows[:, None] * stride_c + cols[None, :]
    tl.store(c, result.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def grouped_gemm(
    inputs: torch.Tensor, weights: torch.Tensor | PackedExperts, alignment: ExpertAlignment, num_rows: int,
    rows_per_input: int, out: torch.Tensor, routing_weights: torch.Tensor | None = None,
    weight_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[row] = inputs[row // rows_per_input] @ weights[expert(row)].T (* routing_weights[row]) for each of
    the `num_rows` aligned rows; weights [E, N, K], or float8 with `weight_scales` [E, N] (fp32), or integer
    (PackedExperts: qweight [E, K // pack, N])."""
    num_tiles = alignment.tile_experts.numel()
    common = dict(BLOCK_M=alignment.block_m, BLOCK_N=BLOCK_N, MUL_ROUTED_WEIGHT=routing_weights is not None,
                  UPCAST=needs_upcast(inputs.dtype), DOT_PRECISION=dot_precision(inputs.dtype), num_warps=4)
    routing = routing_weights if routing_weights is not None else out
    assert inputs.stride(1) == 1 and out.stride(1) == 1
    if isinstance(weights, PackedExperts):
        n_size, k_size, group_size = weights.output_size, weights.input_size, weights.group_size
        qweight, scales = weights.qweight, weights.scales
        zeros = weights.zeros if weights.zeros is not None else scales
        assert k_size == inputs.shape[1] and qweight.stride(2) == scales.stride(2) == zeros.stride(2) == 1
        _grouped_gemm_kernel[(num_tiles, triton.cdiv(n_size, BLOCK_N))](
            inputs, qweight, out, routing, scales, zeros, alignment.sorted_rows, alignment.tile_experts,
            num_rows, n_size, k_size, rows_per_input, group_size,
            inputs.stride(0), qweight.stride(0), qweight.stride(2), qweight.stride(1), out.stride(0),
            scales.stride(0), scales.stride(1), zeros.stride(0), zeros.stride(1),
            BLOCK_K=integer_block_k(k_size, group_size, weights.bits), SCALED=False, BITS=weights.bits,
            HAS_ZEROS=weights.zeros is not None, **common,
        )
        return out
    n_size, k_size = weights.shape[1], weights.shape[2]
    assert weights.shape[2] == inputs.shape[1]
    scaled = weight_scales is not None
    assert not scaled or (weight_scales.dtype == torch.float32 and weight_scales.shape == weights.shape[:2]
                          and weight_scales.stride(1) == 1)
    _grouped_gemm_kernel[(num_tiles, triton.cdiv(n_size, BLOCK_N))](
        inputs, weights, out, routing, weight_scales if scaled else out, out, alignment.sorted_rows,
        alignment.tile_experts, num_rows, n_size, k_size, rows_per_input, 1,
        inputs.stride(0), weights.stride(0), weights.stride(1), weights.stride(2), out.stride(0),
        weight_scales.stride(0) if scaled else 0, 0, 0, 0,
        BLOCK_K=BLOCK_K, SCALED=scaled, BITS=0, HAS_ZEROS=False, **common,
    )
    return out


def integer_block_k(k_size: int, group_size: int, bits: int) -> int:
    """BLOCK_K of the integer variant: BLOCK_K, halved until it divides the group (a step reads one scale row),
    at least 16 (tl.dot's smallest K; a multiple of the 8 values an int32 packs); any when one group is all of
    K. Raises ValueError for a group it cannot tile."""
    block_k = BLOCK_K
    if group_size != k_size:
        while group_size % block_k and block_k > SMALLEST_BLOCK_K:
            block_k //= 2
        if group_size % block_k:
            raise ValueError(f"group_size {group_size} is not a multiple of {SMALLEST_BLOCK_K} (nor all of K)")
    assert block_k % (32 // bits) == 0
    return block_k


def tile_rows(num_tokens: int, num_experts: int) -> int:
    """BLOCK_M: 16 while a batch gives each expert few rows (decode), 64 for prefill-sized batches (vLLM's
    default choice); two variants, each one compile."""
    return 16 if num_tokens <= num_experts else 64


def fused_moe(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor | PackedExperts,
    w2: torch.Tensor | PackedExperts,
    top_k: int,
    renormalize: bool,
    round_routing_weights: bool,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_m: int | None = None,
) -> torch.Tensor:
    """Same contract as kernels/fused_moe_ref.py: hidden [T, H], router_logits [T, E], w13 [E, 2I, H],
    w2 [E, H, I] -> [T, H]; float8 experts with their scales w13_scale [E, 2I], w2_scale [E, H]; integer experts
    as PackedExperts.

    `block_m` fixes the GEMMs' row tile; None picks it by the batch (`tile_rows`: 16 or 64), which changes
    the tile shape (on a GPU the MMA instruction, and so a row's accumulation) with T. A fixed value makes a
    row's result independent of the batch (kernels/batch_invariant_layer_ops.py passes one)."""
    num_tokens, num_experts = router_logits.shape
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    weights, expert_ids = select_experts(router_logits, top_k, renormalize, round_routing_weights)
    num_rows = num_tokens * top_k
    alignment = align_rows_to_experts(
        expert_ids, num_experts, tile_rows(num_tokens, num_experts) if block_m is None else block_m
    )
    gate_up = torch.empty(num_rows, _output_size(w13), dtype=hidden.dtype, device=hidden.device)
    grouped_gemm(hidden, w13, alignment, num_rows, top_k, gate_up, weight_scales=w13_scale)
    activated = silu_and_mul(gate_up)
    weighted = torch.empty(num_rows, _output_size(w2), dtype=torch.result_type(hidden, weights), device=hidden.device)
    grouped_gemm(activated, w2, alignment, num_rows, 1, weighted, weights.reshape(-1), w2_scale)
    return weighted_sum_over_choices(weighted, top_k, hidden.dtype)


def _output_size(weights: torch.Tensor | PackedExperts) -> int:
    return weights.output_size if isinstance(weights, PackedExperts) else weights.shape[1]
