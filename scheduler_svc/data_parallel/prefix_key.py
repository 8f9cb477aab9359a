"""A request's prefix key for routing: the prefix-cache key (core/block_hash.py) of its prompt's first block,
computed by the front from the request alone.

Token ids: the first `block_size` ids, keyed as the engine keys its first block (a LoRA adapter's requests from
a root key of the adapter's name: the engine's root key also covers the adapter's directory, which the front
does not know; routing needs only a key that is the same for every request of one adapter and prefix). Text and chat: the text as the scheduler renders it (the same
`render_chat`, chat template and options included), then only its head is encoded, with the scheduler's
add_special_tokens defaults: `block_size` tokens span at most block_size * max_token_chars *
MAX_NORMALIZATION_FOLD characters, so the head's first block is the prompt's first block (tokenizers split
text locally) and the cost is bounded whatever the prompt's length. A prompt shorter than a block is keyed by
the ids it has. Why the first block only: a multi-turn chat's later turns extend the earlier ones, so the only
key every turn shares is the start of the conversation; longer keys would split one chat's turns.

None when the front cannot read the prompt (malformed bytes, no tokenizer, a chat the template refuses): the
router then balances by load and the engine gives the client its refusal.
"""

from __future__ import annotations

from protos.pagedserve.v1 import generate_pb2
from scheduler_svc.api.prompt_encoding import MAX_NORMALIZATION_FOLD, render_chat
from scheduler_svc.core.block_hash import BlockKey, adapter_root_key, chain_block_key
from scheduler_svc.core.validated_request import InvalidRequestError
from scheduler_svc.text.tokenizer import Tokenizer


def prefix_key(request: generate_pb2.GenerateRequest, tokenizer: Tokenizer | None, block_size: int) -> BlockKey | None:
    ids = _first_block_ids(request, tokenizer, block_size)
    if not ids:
        return None
    return chain_block_key(adapter_root_key(request.lora_name, "") if request.lora_name else None, ids)


def _first_block_ids(request: generate_pb2.GenerateRequest, tokenizer: Tokenizer | None,
                     block_size: int) -> list[int]:
    kind = request.WhichOneof("prompt")
    if kind == "token_ids":
        return list(request.token_ids.ids[:block_size])
    if kind not in ("text", "chat") or tokenizer is None:
        return []
    try:
        text = request.text if kind == "text" else render_chat(request.chat, tokenizer)
    except InvalidRequestError:
        return []
    add_special_tokens = (request.add_special_tokens if request.HasField("add_special_tokens")
                          else kind == "text")
    head = text[:block_size * tokenizer.max_token_chars * MAX_NORMALIZATION_FOLD]
    return tokenizer.encode(head, add_special_tokens=add_special_tokens)[:block_size]
