"""vLLM's `LoRARequest` for the offline LLM: which served LoRA adapter a prompt runs with.

    llm = LLM(model, enable_lora=True, lora_modules={"sql": "/adapters/sql"})
    llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql"))

In this slice the server loads its adapters at start (docs/lora.md), so a request may name only an adapter the
LLM was started with (`lora_modules`); its path must be that adapter's. `lora_int_id` is vLLM's unique id of the
adapter: kept for vLLM's signature, the server selects adapters by name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None


def lora_module_flags(lora_modules: Mapping[str, str] | Sequence[Any]) -> list[str]:
    """LLM's `lora_modules` as `--lora-modules` values: {name: path}, or a list of "name=path" strings, vLLM's
    JSON dicts ({"name", "path", "base_model_name"}) or LoRARequests."""
    if isinstance(lora_modules, Mapping):
        return [f"{name}={path}" for name, path in lora_modules.items()]
    flags = []
    for module in lora_modules:
        if isinstance(module, LoRARequest):
            module = {"name": module.lora_name, "path": module.lora_path, "base_model_name": module.base_model_name}
        if isinstance(module, Mapping):
            flags.append(json.dumps(dict(module)))
        else:
            flags.append(str(module))
    return flags


def lora_names(requests: LoRARequest | Sequence[LoRARequest | None] | None, count: int,
               served_paths: Mapping[str, str]) -> list[str | None]:
    """Each prompt's adapter name (None: the base model) from `lora_request` (one for all prompts, or one per
    prompt); ValueError for an adapter the LLM was not started with, or one whose path is another's."""
    if requests is None or isinstance(requests, LoRARequest):
        requests = [requests] * count
    elif len(requests) != count:
        raise ValueError(f"{len(requests)} lora_request for {count} prompts")
    names = []
    for request in requests:
        if request is None:
            names.append(None)
            continue
        path = served_paths.get(request.lora_name)
        if path is None:
            raise ValueError(f"LoRA adapter {request.lora_name!r} is not served: the server loads its adapters at "
                             "start; pass them as LLM(..., enable_lora=True, lora_modules={name: path})")
        if request.lora_path and os.path.realpath(request.lora_path) != os.path.realpath(path):
            raise ValueError(f"LoRA adapter {request.lora_name!r}: lora_path {request.lora_path!r} is not the "
                             f"served adapter's ({path!r})")
        names.append(request.lora_name)
    return names
