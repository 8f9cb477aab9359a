"""Our native Llama/Qwen2 over a paged KV cache reproduces transformers token for token (float32, CPU),
and rounds where transformers rounds in bf16."""

from __future__ import annotations

import json

import pytest
import torch

from pagedserve.testing.hf_reference import bf16_prefill_errors
from pagedserve.testing.paged_runner import greedy_generate_paged, prefill_logits_paged
from pagedserve.testing.tiny_models import OPT_350M_OVERRIDES, make_tiny_model
from worker_svc.layers.rotary_embedding import RotaryEmbedding
from worker_svc.model_config import ModelConfig
from worker_svc.models.model_loader import load_model

PROMPT_LENS = [5, 17, 33]
NEW_TOKENS = 20


def make_prompts(vocab_size: int, lens: list[int], seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lens]


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=max_new_tokens,
        )
    return out[0, len(prompt) :].tolist()


def hf_logits(hf_model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0].float()


ARCHITECTURES = ["llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3"]
MODEL_TYPES = {"gemma3": "gemma3_text"}
# OPT's variants: pre-norm (125m) and post-norm with projections in and out (350m).
OPT_VARIANTS = {"opt": {}, "opt-350m": OPT_350M_OVERRIDES}


def tiny_checkpoint(directory, name: str, **overrides):
    if name in OPT_VARIANTS:
        return make_tiny_model(directory, "opt", seed=0, **OPT_VARIANTS[name], **overrides)
    return make_tiny_model(directory, arch=name, seed=0, **overrides)


@pytest.fixture(scope="module", params=ARCHITECTURES + list(OPT_VARIANTS))
def model_pair(request, tmp_path_factory):
    """(arch, our model, our config, HF model) for one tiny random checkpoint."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    model, config = load_model(path, torch.float32, "cpu")
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, model, config, hf_model


def test_config_reads_tiny_checkpoint(model_pair):
    arch, _, config, hf_model = model_pair
    if arch in OPT_VARIANTS:
        assert (config.model_type, config.num_key_value_heads, config.head_dim) == ("opt", 4, 16)
        assert config.intermediate_size == 128 and config.tie_word_embeddings and config.rope_scaling is None
        return
    assert config.model_type == MODEL_TYPES.get(arch, arch)
    head_dim = 32 if arch == "qwen3" else 16  # Qwen3's is explicit, not hidden / heads
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, head_dim)
    assert config.attention_bias == (arch == "qwen2")
    assert config.tie_word_embeddings == (arch != "llama")
    rope = hf_model.config.rope_parameters
    assert config.rope_theta == rope.get("full_attention", rope)["rope_theta"]
    windowed = arch in ("gemma2", "gemma3")
    assert list(config.layer_types) == hf_model.config.layer_types if windowed else config.sliding_window is None
    assert config.sliding_window == (8 if windowed else None)


def test_batched_paged_prefill_logits_match_hf(model_pair):
    _, model, config, hf_model = model_pair
    prompts = make_prompts(config.vocab_size, PROMPT_LENS)
    ours = prefill_logits_paged(model, config, prompts, block_size=16, seed=3)
    for prompt, logits in zip(prompts, ours):
        expected = hf_logits(hf_model, prompt)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        # Prompt logprobs are these rows' log-softmax: within 1e-4 of transformers' too.
        torch.testing.assert_close(logits.log_softmax(-1), expected.log_softmax(-1), atol=1e-4, rtol=0)


@pytest.mark.parametrize("prefill_chunk", [None, 7], ids=["whole_prefill", "chunked_prefill"])
def test_batched_paged_greedy_decode_matches_hf_generate(model_pair, prefill_chunk):
    _, model, config, hf_model = model_pair
    prompts = make_prompts(config.vocab_size, PROMPT_LENS)
    ours = greedy_generate_paged(
        model, config, prompts, NEW_TOKENS, block_size=16, prefill_chunk=prefill_chunk, seed=5
    )
    for prompt, generated in zip(prompts, ours):
        assert generated == hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert len(set(generated)) > 1


def test_llama3_rope_scaling_matches_hf(tmp_path):
    from transformers import AutoModelForCausalLM

    rope_scaling = dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32,
    )
    path = make_tiny_model(tmp_path, "llama", seed=2, rope_scaling=dict(rope_scaling), num_hidden_layers=2)
    model, config = load_model(path, torch.float32, "cpu")
    assert config.rope_scaling_params() == rope_scaling
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = make_prompts(config.vocab_size, [70, 9])
    for prompt, logits in zip(prompts, prefill_logits_paged(model, config, prompts)):
        torch.testing.assert_close(logits, hf_logits(hf_model, prompt), atol=1e-4, rtol=1e-4)


def test_load_model_in_bf16_keeps_rotary_cache_fp32_and_stays_close(model_pair, tmp_path):
    arch, model, config, _ = model_pair
    path = tiny_checkpoint(tmp_path, arch)
    bf16_model, _ = load_model(path, torch.bfloat16, "cpu")
    assert all(parameter.dtype == torch.bfloat16 for parameter in bf16_model.parameters())
    rotaries = [module for module in bf16_model.modules() if isinstance(module, RotaryEmbedding)]
    assert all(rotary.cos_sin_cache.dtype == torch.float32 for rotary in rotaries)
    assert rotaries or arch in OPT_VARIANTS  # OPT's positions are learned
    prompts = make_prompts(config.vocab_size, [17])
    ours_fp32 = prefill_logits_paged(model, config, prompts)[0]
    ours_bf16 = prefill_logits_paged(bf16_model, config, prompts, kv_cache_dtype=torch.bfloat16)[0]
    assert (ours_bf16.argmax(-1) == ours_fp32.argmax(-1)).float().mean() > 0.8


def test_bf16_prefill_logits_round_where_transformers_rounds(model_pair, tmp_path):
    """Our bf16 model (torch layer ops, reference attention) against transformers in bf16 with flash
    attention's rounding (tests/hf_reference.py says why that attention): the same computation, so the
    error must be far below bf16's own error against fp32. Measured: 0 (bit-identical logits), against
    bf16-vs-fp32 errors of 0.017-0.037; with attention probabilities kept in fp32 it was 0.012-0.017
    (0.43-0.76 of bf16's error)."""
    arch, _, config, _ = model_pair
    path = tiny_checkpoint(tmp_path, arch)
    bf16_model, _ = load_model(path, torch.bfloat16, "cpu")
    prompts = make_prompts(config.vocab_size, [*PROMPT_LENS, 70])
    ours = prefill_logits_paged(bf16_model, config, prompts, kv_cache_dtype=torch.bfloat16)
    for prompt, logits in zip(prompts, ours):
        ours_vs_hf, hf_bf16_vs_fp32 = bf16_prefill_errors(path, prompt, logits)
        assert ours_vs_hf < 0.1 * hf_bf16_vs_fp32, (len(prompt), ours_vs_hf, hf_bf16_vs_fp32)


def write_config(tmp_path, **raw) -> ModelConfig:
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return ModelConfig.from_hf_dir(tmp_path)


MISTRAL = dict(
    architectures=["MistralForCausalLM"], model_type="mistral", vocab_size=100, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    rope_theta=10000.0, eos_token_id=[2, 7],
)


def test_mistral_sliding_window_slides_every_layer(tmp_path):
    config = write_config(tmp_path, **MISTRAL, sliding_window=256)
    assert config.layer_types == ("sliding_attention",) * 2 and config.sliding_window == 256
    assert [config.layer_sliding_window(i) for i in range(2)] == [256, 256]


def test_a_window_as_long_as_the_context_slides_nothing(tmp_path):
    config = write_config(tmp_path, **MISTRAL, sliding_window=1024)
    assert config.sliding_window is None and config.layer_sliding_window(0) is None


def test_mistral_without_sliding_window_is_llama(tmp_path):
    config = write_config(tmp_path, **MISTRAL, sliding_window=None)
    assert config.architecture == "MistralForCausalLM" and config.eos_token_ids == (2, 7)
    assert config.head_dim == 16 and config.rope_scaling is None and config.sliding_window is None


def test_qwen2_with_disabled_sliding_window_is_accepted(tmp_path):
    raw = {**MISTRAL, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "sliding_window": 128,
           "use_sliding_window": False, "eos_token_id": 5}
    config = write_config(tmp_path, **raw)
    assert config.model_type == "qwen2" and config.attention_bias and config.eos_token_ids == (5,)
    assert config.sliding_window is None


def test_qwen2_slides_from_max_window_layers_on(tmp_path):
    raw = {**MISTRAL, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "sliding_window": 128,
           "use_sliding_window": True, "max_window_layers": 1}
    config = write_config(tmp_path, **raw)
    assert config.layer_types == ("full_attention", "sliding_attention") and config.sliding_window == 128


def test_unknown_rope_scaling_is_refused_in_the_older_rope_scaling_key_too(tmp_path):
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported"):
        write_config(tmp_path, **MISTRAL, rope_scaling={"type": "dynamic", "factor": 4.0})
