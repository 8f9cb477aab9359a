"""`pagedserve serve --kv-cache-dtype fp8` through the real processes on a tiny random model: concurrent greedy
requests with prefix caching, chunked prefill and preemption by swap give the tokens and logprobs of the same
engine with an fp32 KV cache, within the fp8 cache's tolerance (docs/kv_cache_fp8.md)."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.testing.server_harness import running_server
from pagedserve.testing.tiny_models import make_tiny_model

MAX_TOKENS = 16
# Stated tolerances (measured on 2026-11-28, docs/kv_cache_fp8.md: agreement 0.571 (16/28), max |logprob
# difference| 0.37, mean 0.10). Greedy agreement: the share of output positions whose token equals the fp32-KV
# engine's, counted up to and including each request's first difference (after it the contexts differ). A tiny
# random model's next-token logits are nearly flat, so e4m3's 2**-4 relative error on each K/V element flips many
# greedy choices; real models have far larger margins.
MIN_GREEDY_AGREEMENT = 0.5
# |logprob difference| of the chosen token where both engines chose it.
MAX_LOGPROB_DIFFERENCE = 0.5


# The checkpoint carries per-layer k/v scales, as a calibrated fp8 checkpoint does, so that loading them runs
# through the processes too (the fp32-KV engine ignores them). A power of two: it moves the stored values'
# exponents only, so the comparison measures e4m3's 3 mantissa bits, not a badly chosen scale.
KV_SCALE = 2.0**-2


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=21)
    tensors = load_file(path / "model.safetensors")
    layers = {name.split(".")[2] for name in tensors if name.startswith("model.layers.")}
    for layer in layers:
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(KV_SCALE)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(KV_SCALE)
    save_file(tensors, path / "model.safetensors")
    return path


def _prompts(count: int, seed: int) -> list[list[int]]:
    """A shared 40-token prefix (prefix-cache hits) and tails of 1 to 40 tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(512) for _ in range(40)]
    return [prefix + [rng.randrange(512) for _ in range(rng.randrange(1, 41))] for _ in range(count)]


def _serve(tmp_path, model, prompts, *flags):
    """(token ids, chosen-token logprobs) of each prompt, and the server's stats, from concurrent greedy requests
    with chunked prefill (24-token steps) and a pool of 10 blocks that forces swaps. Checks that ModelInfo
    reports the KV cache's dtype."""
    with running_server(tmp_path, "--model", str(model), "--max-num-batched-tokens", "24", "--num-kv-blocks", "10",
                        "--preemption-mode", "swap", "--swap-space", "0.01", *flags) as server:
        with server.client() as client:
            assert client.model_info().kv_cache_dtype == ("fp8_e4m3" if flags else "auto")
        def one(prompt):
            with server.client() as client:
                (output,) = client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                            logprobs=0).outputs
                return list(output.token_ids), list(output.logprobs)

        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(one, prompts))
        stats = server.wait_all_blocks_free()
    return results, stats


def test_fp8_kv_greedy_matches_the_fp32_kv_engine_within_tolerance(llama, tmp_path):
    prompts = _prompts(12, seed=7)
    reference, _ = _serve(tmp_path, llama, prompts)
    fp8, stats = _serve(tmp_path, llama, prompts, "--kv-cache-dtype", "fp8")
    assert stats.num_preemptions > 0 and stats.num_swapped_out_blocks > 0, "the pool was meant to force swaps"
    assert stats.prefix_cache_hit_tokens > 0
    agreed = compared = 0
    differences = []
    for (ref_tokens, ref_logprobs), (tokens, logprobs) in zip(reference, fp8):
        for position in range(MAX_TOKENS):
            compared += 1
            if tokens[position] != ref_tokens[position]:
                break
            agreed += 1
            differences.append(abs(logprobs[position] - ref_logprobs[position]))
    agreement = agreed / compared
    print(f"fp8 KV vs fp32 KV: greedy agreement {agreement:.3f} ({agreed}/{compared}), "
          f"identical requests {sum(a[0] == b[0] for a, b in zip(reference, fp8))}/{len(prompts)}, "
          f"max |logprob diff| {max(differences):.4f}, mean {sum(differences) / len(differences):.4f}")
    assert agreement >= MIN_GREEDY_AGREEMENT
    assert max(differences) <= MAX_LOGPROB_DIFFERENCE
    assert max(differences) > 0, "an fp8 cache that changed no logprob was not in use"
