"""One model card, the object /v1/models lists and /v1/models/{id} returns, in vLLM's shape (OpenAI's plus
`root`, `parent`, `max_model_len` and `permission`).

Why one builder: both routes must describe the model identically, and what a card says about the model
(its context length, the generation defaults and the version) is read from ModelInfo in this one place.
"""

from __future__ import annotations

import time

from client.types import ModelInfo

OWNED_BY = "pagedserve"


def model_cards(served_name: str, info: ModelInfo) -> list[dict]:
    """What /v1/models lists: the served model, then each LoRA adapter (vLLM lists them alike)."""
    return [model_card(served_name, info), *(model_card(a.name, info, served_name) for a in info.lora_adapters)]


def model_card(served_name: str, info: ModelInfo, base_name: str | None = None) -> dict:
    """`served_name` is what clients send as `model` (--served-model-name, else the model's own name; or a LoRA
    adapter's name, whose card has `parent` = `base_name`, the base model's id, as vLLM's)."""
    adapter = next((a for a in info.lora_adapters if a.name == served_name), None) if base_name else None
    return {
        "id": served_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": OWNED_BY,
        "root": info.model_name if adapter is None else adapter.name,
        "parent": None if adapter is None else adapter.base_model_name or base_name,
        "max_model_len": info.max_model_len,
        "permission": [],
        # Not in vLLM's card: what unset sampling fields take, and from where.
        "default_sampling": info.default_sampling,
        "generation_config": info.generation_config,
        "version": info.version,
        "batch_invariant": info.batch_invariant,
        "quantization": info.quantization or None,
        "kv_cache_dtype": info.kv_cache_dtype,
    }
