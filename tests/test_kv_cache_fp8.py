"""The fp8 KV cache (`--kv-cache-dtype fp8`) on the CPU: the torch reference's quantized write and dequantized
attention, its distance from an fp32 cache, the pool's bytes (twice the blocks of bf16 in the same memory), swaps
and copies that keep the bits, the checkpoint's k/v scales reaching the attention layers, and the flag."""

from __future__ import annotations

import argparse
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.kv_quant import FP8_KV_DTYPE, KV_CACHE_DTYPES, KVScales, kv_cache_dtype, quantize
from kernels.paged_attention_ref import paged_attention, write_kv_cache
from pagedserve.testing.paged_runner import build_metadata, shuffled_block_tables
from pagedserve.testing.tiny_models import make_tiny_model
from worker_svc.config import KV_CACHE_DTYPES as FLAG_VALUES
from worker_svc.config import WorkerConfig, add_worker_arguments, worker_config_from_args
from worker_svc.kv_cache import KVCache, bytes_per_block
from worker_svc.kv_cache_sizing import num_kv_blocks
from worker_svc.layers.attention import Attention
from worker_svc.model_config import ModelConfig
from worker_svc.models.model_loader import load_model

BLOCK = 16
SCALES = KVScales(k=0.02, v=0.5)
# The stated tolerance against an fp32 cache: e4m3 keeps 3 mantissa bits, so each stored K/V element is off by up
# to 2**-4 of itself, and an output (a softmax-weighted mean of values ~N(0, 1)) by up to 2**-4 of the largest
# value it averages. Measured on these cases (seeds 0-3): max |error| 0.11-0.14, mean 0.009, outputs up to 3.2.
FP8_VS_FP32_MAX_ERROR = 0.2
FP8_VS_FP32_MEAN_ERROR = 0.015


def _case(dtype, seed=0):
    """Keys ~N(0, 1), values ~N(0, 1); contexts around block boundaries; (query, fp32 pool, fp8 pool, metadata)."""
    generator = torch.Generator().manual_seed(seed)
    seq_lens, query_lens = [1, 16, 17, 40, 70], [1, 1, 5, 40, 13]
    blocks_per_seq = [-(-n // BLOCK) for n in seq_lens]
    tables = shuffled_block_tables(blocks_per_seq, sum(blocks_per_seq) + 2, random.Random(seed))
    everything = build_metadata(tables, seq_lens, seq_lens, BLOCK)
    keys = torch.randn(len(everything.slot_mapping), 2, 32, generator=generator)
    values = torch.randn(keys.shape, generator=generator)
    shape = (2, sum(blocks_per_seq) + 2, BLOCK, 2, 32)
    exact, fp8 = torch.zeros(shape), torch.zeros(shape, dtype=FP8_KV_DTYPE)
    write_kv_cache(keys, values, exact, everything.slot_mapping)
    write_kv_cache(keys.to(dtype), values.to(dtype), fp8, everything.slot_mapping, SCALES)
    metadata = build_metadata(tables, seq_lens, query_lens, BLOCK)
    query = torch.randn(len(metadata.slot_mapping), 8, 32, generator=generator)
    return query.to(dtype), exact, fp8, metadata


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_over_an_fp8_pool_is_attention_over_its_dequantized_values(dtype):
    query, _, fp8, metadata = _case(dtype)
    dequantized = torch.stack([fp8[0].float() * SCALES.k, fp8[1].float() * SCALES.v]).to(dtype)
    output = paged_attention(query, fp8, metadata, 32**-0.5, kv_scales=SCALES)
    assert output.dtype == dtype
    assert torch.equal(output, paged_attention(query, dequantized, metadata, 32**-0.5))


def test_attention_over_an_fp8_pool_is_within_the_stated_tolerance_of_an_fp32_pool():
    query, exact, fp8, metadata = _case(torch.float32, seed=1)
    output = paged_attention(query, fp8, metadata, 32**-0.5, kv_scales=SCALES)
    expected = paged_attention(query, exact, metadata, 32**-0.5)
    error = (output - expected).abs()
    assert 0 < error.max() < FP8_VS_FP32_MAX_ERROR and error.mean() < FP8_VS_FP32_MEAN_ERROR
    # The scales matter: read as if they were 1, the same pool is far off.
    assert (paged_attention(query, fp8, metadata, 32**-0.5) - expected).abs().max() > 1.0


def test_the_write_divides_by_the_scale_and_clamps_to_448():
    key = torch.tensor([[[1.0, -1.0, 100.0, -100.0]]])
    cache = torch.zeros((2, 1, BLOCK, 1, 4), dtype=FP8_KV_DTYPE)
    write_kv_cache(key, key, cache, torch.tensor([3]), KVScales(k=0.01, v=2.0))
    assert cache[0, 0, 3, 0].float().tolist() == [96.0, -96.0, 448.0, -448.0]  # 100 -> e4m3's nearest 96
    assert cache[1, 0, 3, 0].float().tolist() == [0.5, -0.5, 48.0, -48.0]
    assert quantize(torch.tensor([1.0]), 3.0, torch.bfloat16).item() == 1.0  # a cache of the model's dtype: a cast


def test_fp8_blocks_take_half_the_bytes_so_the_pool_gets_twice_the_blocks(tmp_path):
    model_config = ModelConfig.from_path(make_tiny_model(tmp_path, "llama", seed=1))
    assert bytes_per_block(model_config, BLOCK, FP8_KV_DTYPE) * 2 == bytes_per_block(model_config, BLOCK,
                                                                                      torch.bfloat16)
    config = WorkerConfig(cpu_kv_cache_space=0.01, kv_cache_dtype="fp8")
    blocks = {dtype: num_kv_blocks(config, None, model_config, BLOCK, 64, 4, 256, dtype, torch.device("cpu"))
              for dtype in (torch.bfloat16, FP8_KV_DTYPE)}
    assert blocks[FP8_KV_DTYPE] // 2 == blocks[torch.bfloat16] > 0  # (the budget floors to whole blocks)


def test_swaps_and_copies_of_an_fp8_pool_keep_the_bits(tmp_path):
    model_config = ModelConfig.from_path(make_tiny_model(tmp_path, "llama", seed=1))
    cache = KVCache(model_config, 6, 4, BLOCK, FP8_KV_DTYPE, torch.device("cpu"))
    assert cache.layers[0].dtype == cache.swap_layers[0].dtype == FP8_KV_DTYPE
    for layer in cache.layers:
        layer.view(torch.uint8).copy_(torch.randint(0, 120, layer.shape, dtype=torch.uint8))
    before = [layer.clone() for layer in cache.layers]
    cache.swap_out([(1, 0), (2, 3)])
    cache.swap_in([(0, 4), (3, 5)])
    cache.copy([(1, 0)])
    for old, new in zip(before, cache.layers):
        assert torch.equal(new.view(torch.uint8)[:, [4, 5, 0]], old.view(torch.uint8)[:, [1, 2, 1]])


def test_checkpoint_kv_scales_reach_the_attention_layers_in_every_spelling(tmp_path):
    path = make_tiny_model(tmp_path, "llama", seed=2)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.25)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor([0.5])
    tensors["model.layers.1.self_attn.kv_scale"] = torch.tensor(2.0)  # deprecated: both K and V
    save_file(tensors, path / "model.safetensors")
    model, _ = load_model(path, torch.float32, "cpu")
    layers = [module for module in model.modules() if isinstance(module, Attention)]
    assert [layer.kv_scales for layer in layers[:2]] == [KVScales(0.25, 0.5), KVScales(2.0, 2.0)]
    assert all(layer.kv_scales == KVScales() for layer in layers[2:])
    tensors.pop("model.layers.1.self_attn.kv_scale")
    tensors["model.layers.1.self_attn.k_proj.k_scale"] = torch.tensor(3.0)  # ModelOpt's names
    tensors["model.layers.1.self_attn.v_proj.v_scale"] = torch.tensor(4.0)
    save_file(tensors, path / "model.safetensors")
    model, _ = load_model(path, torch.float32, "cpu")
    assert [m for m in model.modules() if isinstance(m, Attention)][1].kv_scales == KVScales(3.0, 4.0)


def test_the_flag_takes_auto_fp8_and_fp8_e4m3_and_refuses_the_rest_naming_them(capsys):
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, shared_only=False)
    assert set(FLAG_VALUES) == {"auto", *KV_CACHE_DTYPES}
    for name in FLAG_VALUES:
        config = worker_config_from_args(parser.parse_args(["--kv-cache-dtype", name]))
        assert kv_cache_dtype(config.kv_cache_dtype, torch.bfloat16) == (
            torch.bfloat16 if name == "auto" else FP8_KV_DTYPE)
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp8_e5m2"])
    assert "'fp8_e5m2' is not supported; supported: auto, fp8, fp8_e4m3" in capsys.readouterr().err
