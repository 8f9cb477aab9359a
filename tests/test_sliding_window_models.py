"""Mistral (every layer slides) and Qwen2 with its upper layers sliding reproduce transformers token for token
(float32, CPU) on prompts longer than their window, whole or in prefill chunks that cross the window's start,
and round where transformers rounds in bf16. The windows (20 and 12) are shorter than most prompts here, so
a model that ignored them would differ (checked below, so these tests cannot pass with the window deleted).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedserve.testing.hf_reference import bf16_prefill_errors, hf_greedy
from pagedserve.testing.paged_runner import greedy_generate_paged, prefill_logits_paged
from pagedserve.testing.tiny_models import QWEN2_SLIDING_WINDOW, make_tiny_model
from worker_svc.model_config import FULL_ATTENTION
from worker_svc.models.model_loader import load_model
from worker_svc.models.registry import build_model

PROMPT_LENS = [9, 33, 70]
NEW_TOKENS = 20
# (arch, overrides, each layer's window)
WINDOWED = {
    "mistral": ("mistral", {}, [20, 20, 20]),
    "qwen2_window": ("qwen2", QWEN2_SLIDING_WINDOW, [None, 12, 12]),
}


def make_prompts(vocab_size: int, lens: list[int], seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lens]


def hf_logits(model_dir, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf_model(torch.tensor([prompt])).logits[0].float() for prompt in prompts]


@pytest.fixture(scope="module", params=sorted(WINDOWED))
def windowed(request, tmp_path_factory):
    """(model dir, our model, our config, each layer's window) of one tiny windowed checkpoint."""
    arch, overrides, windows = WINDOWED[request.param]
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), arch=arch, seed=0, **overrides)
    model, config = load_model(path, torch.float32, "cpu")
    return path, model, config, windows


def test_each_layer_attends_through_its_configured_window(windowed):
    _, model, config, windows = windowed
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == windows
    assert [config.layer_sliding_window(i) for i in range(config.num_hidden_layers)] == windows


def test_prefill_logits_past_the_window_match_hf_and_need_it(windowed):
    path, model, config, _ = windowed
    prompts = make_prompts(config.vocab_size, PROMPT_LENS)
    expected = hf_logits(path, prompts)
    for logits, reference in zip(prefill_logits_paged(model, config, prompts, seed=3), expected):
        torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)
    full_config = dataclasses.replace(
        config, layer_types=(FULL_ATTENTION,) * config.num_hidden_layers, sliding_window=None
    )
    full = build_model(full_config)
    full.load_state_dict(model.state_dict())
    unwindowed = prefill_logits_paged(full.eval(), full_config, prompts[-1:], seed=3)[0]
    assert (unwindowed - expected[-1]).abs().max() > 1e-2, "the window must change these logits"


@pytest.mark.parametrize("prefill_chunk", [None, 7], ids=["whole_prefill", "chunked_prefill"])
def test_greedy_decode_past_the_window_matches_hf_generate(windowed, prefill_chunk):
    """Chunks of 7 start on both sides of the windows' first keys; the decodes run 20 tokens past them."""
    path, model, config, _ = windowed
    prompts = make_prompts(config.vocab_size, PROMPT_LENS)
    ours = greedy_generate_paged(
        model, config, prompts, NEW_TOKENS, block_size=16, prefill_chunk=prefill_chunk, seed=5
    )
    for prompt, generated in zip(prompts, ours):
        assert generated == hf_greedy(path, prompt, NEW_TOKENS)
        assert len(set(generated)) > 1


def test_bf16_prefill_logits_round_where_transformers_rounds(windowed):
    """As tests/test_models.py's bf16 test, with transformers' reference attention honouring the window."""
    path, _, config, _ = windowed
    bf16_model, _ = load_model(path, torch.bfloat16, "cpu")
    prompts = make_prompts(config.vocab_size, [33, 70])
    ours = prefill_logits_paged(bf16_model, config, prompts, kv_cache_dtype=torch.bfloat16)
    for prompt, logits in zip(prompts, ours):
        ours_vs_hf, hf_bf16_vs_fp32 = bf16_prefill_errors(path, prompt, logits)
        assert ours_vs_hf < 0.1 * hf_bf16_vs_fp32, (len(prompt), ours_vs_hf, hf_bf16_vs_fp32)
