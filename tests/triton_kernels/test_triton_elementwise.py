"""Triton RMSNorm, rotary and SiLU-and-mul equal their torch references (CPU interpreter, see conftest.py).

The references are first checked to equal worker_svc/models/llama.py's modules bit for bit, so the
kernels are held to the model's exact math (HF's cast order). In bf16 the kernels must equal the
references bit for bit too: they compute in fp32 and round exactly where torch's bf16 ops round (the
interpreter rounds like a GPU, see conftest.py); fp32 differs only by summation order and exp/rsqrt.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels import gelu_and_mul_ref, rmsnorm_ref, rotary_ref, silu_and_mul_ref
from kernels.layer_ops import torch_layer_ops
from kernels.triton_rmsnorm import gemma_rms_norm, rms_norm
from kernels.triton_rotary import rotary_embedding
from kernels.triton_silu_and_mul import gelu_and_mul, silu_and_mul
from worker_svc.layers.gated_mlp import GatedMLP
from worker_svc.layers.rms_norm import RMSNorm
from worker_svc.layers.rotary_embedding import RotaryEmbedding
from worker_svc.model_config import ModelConfig
from worker_svc.tensor_parallel import SINGLE_RANK

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 0.0}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def tiny_config(head_dim=64, hidden_size=96, intermediate_size=80) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", model_type="llama", name="tiny", vocab_size=32, hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=1, num_attention_heads=8,
        num_key_value_heads=2, head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_scaling=None, max_position_embeddings=512, tie_word_embeddings=True,
        attention_bias=False, bos_token_id=None, eos_token_ids=(0,),
    )


def assert_close(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tolerance = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=tolerance)


@DTYPES
def test_references_equal_the_model_modules(dtype):
    torch.manual_seed(0)
    config = tiny_config()
    ops = torch_layer_ops()
    norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops).to(dtype)
    nn.init.normal_(norm.weight)
    hidden = torch.randn(5, config.hidden_size, dtype=dtype)
    assert torch.equal(rmsnorm_ref.rms_norm(hidden, norm.weight, norm.eps)[0], hf_rms_norm(norm, hidden))

    rotary = RotaryEmbedding(config, ops)
    positions = torch.tensor([0, 7, 300, 511, 3])
    query = torch.randn(5, 8, config.head_dim, dtype=dtype)
    key = torch.randn(5, 2, config.head_dim, dtype=dtype)
    for got, want in zip(
        rotary_ref.rotary_embedding(positions, query, key, rotary.cos_sin_cache),
        hf_rotary(rotary.cos_sin_cache, positions, query, key),
    ):
        assert torch.equal(got, want)

    mlp = GatedMLP(config, ops, SINGLE_RANK).to(dtype)
    nn.init.normal_(mlp.gate_up_proj.weight)
    gate, up = mlp.gate_up_proj.weight.chunk(2)
    expected = nn.functional.silu(hidden @ gate.T) * (hidden @ up.T)
    assert torch.equal(silu_and_mul_ref.silu_and_mul(mlp.gate_up_proj(hidden)), expected)


def hf_rms_norm(norm: RMSNorm, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, written out."""
    variance = hidden.float().pow(2).mean(-1, keepdim=True)
    return norm.weight * (hidden.float() * torch.rsqrt(variance + norm.eps)).to(hidden.dtype)


def hf_rotary(cos_sin_cache, positions, query, key):
    """transformers' apply_rotary_pos_emb with cos/sin cast to the activation dtype, written out."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos = torch.cat([cos, cos], dim=-1)[:, None, :].to(query.dtype)
    sin = torch.cat([sin, sin], dim=-1)[:, None, :].to(query.dtype)

    def rotate_half(x):
        first, second = x.chunk(2, dim=-1)
        return torch.cat([-second, first], dim=-1)

    return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin


@DTYPES
@pytest.mark.parametrize("hidden_size", [64, 96])
def test_rms_norm_without_residual(dtype, hidden_size):
    torch.manual_seed(0)
    hidden = torch.randn(7, hidden_size, dtype=dtype) * 3
    weight = torch.randn(hidden_size, dtype=dtype)
    normed, residual = rms_norm(hidden, weight, 1e-6)
    expected, _ = rmsnorm_ref.rms_norm(hidden, weight, 1e-6)
    assert_close(normed, expected)
    assert residual is hidden


@DTYPES
def test_rms_norm_adds_the_residual_and_returns_the_sum(dtype):
    torch.manual_seed(0)
    hidden = torch.randn(6, 96, dtype=dtype)
    residual = torch.randn(6, 96, dtype=dtype)
    weight = torch.randn(96, dtype=dtype)
    normed, new_residual = rms_norm(hidden, weight, 1e-5, residual=residual)
    expected, expected_residual = rmsnorm_ref.rms_norm(hidden, weight, 1e-5, residual=residual)
    assert_close(normed, expected)
    assert_close(new_residual, expected_residual)


@DTYPES
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_on_query_and_key_views_of_a_fused_projection(dtype, head_dim):
    torch.manual_seed(0)
    config = tiny_config(head_dim=head_dim)
    cos_sin_cache = RotaryEmbedding(config, torch_layer_ops()).cos_sin_cache
    num_tokens = 5
    qkv = torch.randn(num_tokens, (8 + 2 + 2) * head_dim, dtype=dtype)
    query = qkv[:, : 8 * head_dim].view(num_tokens, 8, head_dim)
    key = qkv[:, 8 * head_dim : 10 * head_dim].view(num_tokens, 2, head_dim)
    positions = torch.tensor([0, 1, 17, 511, 200])
    rotated_query, rotated_key = rotary_embedding(positions, query, key, cos_sin_cache)
    expected_query, expected_key = rotary_ref.rotary_embedding(positions, query, key, cos_sin_cache)
    assert_close(rotated_query, expected_query)
    assert_close(rotated_key, expected_key)


@DTYPES
def test_silu_and_mul_over_several_column_tiles(dtype):
    torch.manual_seed(0)
    gate_up = torch.randn(4, 2 * 300, dtype=dtype) * 4
    assert_close(silu_and_mul(gate_up, block=128), silu_and_mul_ref.silu_and_mul(gate_up))


@DTYPES
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemma_rms_norm_multiplies_one_plus_weight_before_rounding(dtype, with_residual):
    torch.manual_seed(0)
    hidden = torch.randn(6, 96, dtype=dtype) * 3
    residual = torch.randn(6, 96, dtype=dtype) if with_residual else None
    weight = torch.randn(96, dtype=dtype) * 0.3
    normed, new_residual = gemma_rms_norm(hidden, weight, 1e-6, residual=residual)
    expected, expected_residual = rmsnorm_ref.gemma_rms_norm(hidden, weight, 1e-6, residual=residual)
    assert_close(normed, expected)
    assert_close(new_residual, expected_residual)
    assert not torch.allclose(normed.float(), rmsnorm_ref.rms_norm(hidden, weight, 1e-6, residual)[0].float())


def test_gemma_rms_norm_reference_is_transformers_norm():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    torch.manual_seed(0)
    hf_norm = GemmaRMSNorm(96, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        hf_norm.weight.normal_(0, 0.3)
    hidden = torch.randn(5, 96, dtype=torch.bfloat16) * 2
    with torch.no_grad():
        assert torch.equal(rmsnorm_ref.gemma_rms_norm(hidden, hf_norm.weight, 1e-6)[0], hf_norm(hidden))


@DTYPES
def test_tanh_gelu_and_mul_over_several_column_tiles(dtype):
    torch.manual_seed(0)
    gate_up = torch.randn(4, 2 * 300, dtype=dtype) * 4
    # Not bit for bit in bf16: torch's CPU tanh and ours (from exp) differ in the last fp32 bits, which flips
    # the bf16 rounding of ~5% of the outputs by one ulp (torch's own fp32 formula flips 0.5% against it).
    ours, expected = gelu_and_mul(gate_up, "tanh", block=128), gelu_and_mul_ref.gelu_and_mul(gate_up, "tanh")
    assert ours.dtype == expected.dtype
    torch.testing.assert_close(ours.float(), expected.float(), atol=1e-4, rtol=2 ** -7)
    exact = gelu_and_mul_ref.gelu_and_mul(gate_up, "none")
    assert_close(gelu_and_mul(gate_up, "none"), exact)
    assert not torch.equal(exact, gelu_and_mul_ref.gelu_and_mul(gate_up, "tanh"))
