"""vLLM's `--generation-config`: the defaults that requests' unset sampling fields take, from the model's
generation_config.json.

Modes: "auto" reads the model directory's generation_config.json; "vllm" reads no sampling defaults (a
request's unset fields keep vLLM's built-in ones: temperature 1, top_p 1, ...; the file's EOS ids still end
generation, see text/tokenizer_loading.py); any other value is a directory whose generation_config.json is
read. As vLLM, only temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (as max_tokens)
are taken, and only those the file sets. A .gguf model has no generation_config.json: no defaults.
vLLM's `--override-generation-config JSON` sets values (same keys) over the file's, or alone with "vllm".

"Unset" is proto3 presence: a request field that is not present takes the default, one that is present keeps
its value (temperature 0 in a request stays greedy whatever the file says). The defaults apply at the gRPC
edge, before validation, so a bad value in the file is refused like a bad value in a request.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from protos.pagedserve.v1 import generate_pb2

# generation_config.json key -> SamplingParams field, and the type the field holds.
_FILE_FIELDS = {
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "min_p": ("min_p", float),
    "repetition_penalty": ("repetition_penalty", float),
    "max_new_tokens": ("max_tokens", int),
}
# Fields beam search fixes itself (greedy beams): a default for them would only make it refuse the request.
_SAMPLING_ONLY = ("temperature", "top_p", "top_k", "min_p")


@dataclass(frozen=True)
class GenerationDefaults:
    """The sampling defaults one server applies, and where they came from (ModelInfo reports both).

    `source`: "auto", "vllm" or the directory given; `values`: SamplingParams field -> value, only the fields
    the file set (read-only)."""

    source: str = "vllm"
    values: Mapping[str, float | int] = field(default_factory=lambda: MappingProxyType({}))

    def as_sampling_params(self) -> generate_pb2.SamplingParams:
        return generate_pb2.SamplingParams(**self.values)

    def apply(self, request: generate_pb2.SamplingParams) -> generate_pb2.SamplingParams:
        """A copy of `request` whose unset fields take these defaults (beam search keeps its own sampling)."""
        merged = self.as_sampling_params()
        if request.HasField("beam_width") and request.beam_width > 1:
            for name in _SAMPLING_ONLY:
                merged.ClearField(name)
        merged.MergeFrom(request)  # present request fields win; repeated ones come from the request alone
        return merged


def load_generation_defaults(mode: str, model_path: str,
                             overrides: Mapping[str, Any] | None = None) -> GenerationDefaults:
    """The defaults of --generation-config `mode` for the model at `model_path` (a directory or .gguf file),
    with vLLM's --override-generation-config `overrides` (generation_config.json keys) set over them.
    ValueError naming the flag for an unreadable file, a value of the wrong type or an unknown override key."""
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(_FILE_FIELDS))
    if unknown:
        raise ValueError(f"--override-generation-config: unknown keys {unknown}; supported: {sorted(_FILE_FIELDS)}")
    values = {} if mode == "vllm" else _file_values(mode, model_path)
    values.update(_sampling_values(overrides, "--override-generation-config"))
    return GenerationDefaults(mode, MappingProxyType(values))


def _file_values(mode: str, model_path: str) -> dict[str, float | int]:
    directory = model_path if mode == "auto" else mode
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        if mode != "auto":
            raise ValueError(f"--generation-config: {directory} has no generation_config.json")
        return {}
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"--generation-config: cannot read {path}: {error}") from None
    return _sampling_values(config, f"--generation-config: {path}")


def _sampling_values(config: Mapping[str, Any], where: str) -> dict[str, float | int]:
    """SamplingParams field -> value for the keys of _FILE_FIELDS that `config` sets (null: unset)."""
    values = {}
    for key, (name, kind) in _FILE_FIELDS.items():
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise ValueError(f"{where}: {key} must be a number, not {value!r}")
        values[name] = kind(value)
    return values
