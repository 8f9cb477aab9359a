"""Weight-only integer checkpoints through the real processes: an AWQ checkpoint serves concurrent requests with
chunked prefill, prefix-cache hits and preemption by swap, and a GPTQ one (asymmetric, 8-bit act-order on one
rank, 4-bit over two tensor-parallel ranks); each one's greedy output equals the in-process engine's on the
same checkpoint (which tests/test_int_models.py holds equal to transformers on the dequantized weights), and
ModelInfo names the method."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.testing.int_checkpoints import write_awq_checkpoint, write_gptq_checkpoint
from pagedserve.testing.paged_runner import greedy_generate_paged
from pagedserve.testing.server_harness import running_server
from pagedserve.testing.tiny_models import make_tiny_model
from tests.test_e2e_greedy import MAX_TOKENS, _generate_all  # one server's greedy requests, as there
from worker_svc.models.model_loader import load_model

# 10 blocks of 16 tokens hold any one request but not all at once (preemption); 24 tokens a step chunk the
# prompts; prefix caching is on by default.
SMALL_POOL = ["--num-kv-blocks", "10", "--max-num-batched-tokens", "24", "--swap-space", "0.01"]


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 512) for _ in range(40)]
    return [prefix + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 30))] for _ in range(count)]


def _in_process(model_dir, prompts) -> list[list[int]]:
    model, config = load_model(model_dir, torch.float32, "cpu")
    assert config.quantization is not None
    return greedy_generate_paged(model, config, prompts, MAX_TOKENS)


def _serve_and_compare(model_dir, logs, method: str, *flags: str) -> None:
    prompts = _prompts(10, seed=3)
    logs.mkdir()
    with running_server(logs, "--model", str(model_dir), *SMALL_POOL, *flags) as server:
        with server.client() as client:
            assert client.model_info().quantization == method
        before = server.wait_all_blocks_free()
        results = _generate_all(server, prompts[:1]) + _generate_all(server, prompts[1:])  # the first fills the cache
        stats = server.wait_all_blocks_free()
    assert [list(result.token_ids) for result in results] == _in_process(model_dir, prompts)
    assert stats.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens >= 32
    assert stats.num_preemptions > 0, "the pool was meant to force preemptions"
    if "swap" in flags:
        assert stats.num_swapped_out_blocks > 0


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models"), "qwen2", seed=13)


def test_an_awq_checkpoint_serves_with_swaps_and_prefix_hits_like_the_in_process_engine(qwen2, tmp_path):
    model = write_awq_checkpoint(qwen2, tmp_path / "awq", group_size=32)
    _serve_and_compare(model, tmp_path / "logs", "awq", "--preemption-mode", "swap")


def test_an_8bit_act_order_gptq_checkpoint_serves_like_the_in_process_engine(qwen2, tmp_path):
    model = write_gptq_checkpoint(qwen2, tmp_path / "gptq8", bits=8, group_size=32, sym=False, desc_act=True)
    _serve_and_compare(model, tmp_path / "logs", "gptq", "--preemption-mode", "recompute")


def test_a_gptq_checkpoint_over_two_ranks_serves_the_single_rank_tokens(qwen2, tmp_path):
    model = write_gptq_checkpoint(qwen2, tmp_path / "gptq4", bits=4, group_size=32, sym=False)
    _serve_and_compare(model, tmp_path / "logs", "gptq", "-tp", "2", "--preemption-mode", "swap")
