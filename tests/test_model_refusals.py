"""A model or checkpoint the engine cannot serve is refused once, in one line, and never restarted.

What config.json alone shows (a quantization_config, an untied Gemma) `pagedserve serve` refuses before any
child starts; what only the checkpoint's tensors show (one the model has no parameter for) the worker refuses
while loading, with one line and service_runtime/load_refusal.py's exit code, and the launcher stops the
stack without restarting it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.testing.server_harness import REPO_ROOT, free_port
from pagedserve.testing.tiny_models import make_tiny_model
from service_runtime.load_refusal import LOAD_REFUSED_EXIT_CODE, LoadRefused
from tests.test_log_noise import assert_one_line_refusal
from worker_svc.model_config import ModelConfig


def _serve(model_dir, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    argv = ["serve", "--model", str(model_dir), "--no-http", "--grpc-port", str(free_port()), *args]
    return subprocess.run([sys.executable, "-m", "pagedserve", *argv], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _edit_config(model_dir, **keys) -> None:
    config_path = model_dir / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **keys}))


def test_a_bitsandbytes_quantization_config_is_refused_in_one_line_before_any_child_starts(tmp_path):
    """Its tensors here are float: served, they would pass for an unquantized model."""
    model = make_tiny_model(tmp_path, "llama", seed=5)
    _edit_config(model, quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})
    assert_one_line_refusal(_serve(model, timeout=90), "quantization_config", "'bitsandbytes'", "supported: gguf")


def test_an_untied_gemma2_is_refused_in_one_line_before_any_child_starts(tmp_path):
    model = make_tiny_model(tmp_path, "gemma2", seed=5, tie_word_embeddings=False)
    assert_one_line_refusal(_serve(model, timeout=90), "tie_word_embeddings=False")


def test_a_checkpoint_tensor_without_a_parameter_is_refused_by_the_worker_once_in_one_line(tmp_path):
    model = make_tiny_model(tmp_path, "llama", seed=5)
    (weights,) = model.glob("*.safetensors")
    tensors = load_file(weights)
    tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, weights, metadata={"format": "pt"})
    started = time.monotonic()
    result = _serve(model, "--max-worker-restarts", "3")
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "restarting the workers" not in result.stderr, result.stderr[-3000:]
    refusals = [line for line in result.stderr.splitlines() if "cannot serve" in line]
    assert len(refusals) == 2, result.stderr[-3000:]  # the worker's reason, then the launcher's verdict
    assert "extra_proj.weight" in refusals[0] and "has no parameter" in refusals[0]
    assert refusals[1].startswith("pagedserve: cannot serve") and "worker rank 0 refused it" in refusals[1]
    assert f"worker rank 0 exit code {LOAD_REFUSED_EXIT_CODE}" in result.stderr
    assert elapsed < 60, f"{elapsed:.0f} s"  # the scheduler, waiting for its worker, stops with the rest


def _gemma2_config(model_dir, **keys) -> None:
    config = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 512, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16,
              "max_position_embeddings": 512, **keys}
    (model_dir / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("keys, words", [
    ({"quantization_config": {"quant_method": "hqq", "nbits": 4}}, ("quant_method 'hqq'",)),
    ({"tie_word_embeddings": False}, ("tie_word_embeddings=False",)),
    ({"hidden_activation": "relu"}, ("hidden_activation 'relu'",)),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "dynamic", "factor": 2.0}}}, ("'dynamic'",)),
])
def test_model_config_refuses_what_the_gemma_model_file_cannot_serve(tmp_path, keys, words):
    """ModelConfig is what the launcher reads before any child starts: each refusal must be found there."""
    _gemma2_config(tmp_path, **keys)
    with pytest.raises(ValueError) as refused:
        ModelConfig.from_path(tmp_path)
    assert all(word in str(refused.value) for word in words), refused.value


def test_a_gemma_config_without_tie_word_embeddings_is_tied_as_transformers_reads_it(tmp_path):
    _gemma2_config(tmp_path)  # transformers' Gemma config classes default to tied, so config.json may omit it
    assert ModelConfig.from_path(tmp_path).tie_word_embeddings is True


def test_the_refused_activations_are_those_the_model_files_lack():
    """feature_refusals.py names the activations without importing torch; the model files compute them."""
    from worker_svc.layers.gated_mlp import GELU_APPROXIMATIONS
    from worker_svc.models.feature_refusals import GEMMA_ACTIVATIONS, OPT_ACTIVATIONS
    from worker_svc.models.opt import ACTIVATIONS

    assert set(GEMMA_ACTIVATIONS) == set(GELU_APPROXIMATIONS) and set(OPT_ACTIVATIONS) == set(ACTIVATIONS)


def test_a_misshapen_checkpoint_tensor_is_a_load_refusal(tmp_path):
    from worker_svc.models.model_loader import load_model

    model = make_tiny_model(tmp_path, "llama", seed=5)
    (weights,) = model.glob("*.safetensors")
    tensors = load_file(weights)
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(LoadRefused, match=r"model\.norm\.weight: checkpoint shape \(65,\)"):
        load_model(model, torch.float32, "cpu")


def test_a_value_error_raised_inside_a_library_while_loading_is_a_bug_with_its_traceback_not_a_refusal():
    import numpy as np

    from worker_svc.models.model_loader import refused_as_load_refusal

    with pytest.raises(ValueError) as bug, refused_as_load_refusal():
        np.zeros(2).reshape(3)  # numpy raises it: not a check of ours (test_a_misshapen_... is one)
    assert not isinstance(bug.value, LoadRefused)
