"""The Tokenize and Detokenize RPCs (the gateway's /tokenize and /detokenize, vLLM's): the served model's
tokenizer, with a prompt encoded exactly as Generate encodes it (prompt_encoding.py), chat options included.

A large text is encoded on a worker thread, as Generate's (prompt_encoding.OFF_LOOP_PROMPT_CHARS).
"""

from __future__ import annotations

import asyncio

from protos.pagedserve.v1 import generate_pb2
from scheduler_svc.api.prompt_encoding import OFF_LOOP_PROMPT_CHARS, encode_prompt, prompt_chars
from scheduler_svc.api.request_limits import RequestLimitError
from scheduler_svc.api.request_validation import ServingLimits
from scheduler_svc.core.validated_request import InvalidRequestError
from scheduler_svc.text.tokenizer import Tokenizer


async def tokenize(request: generate_pb2.TokenizeRequest, tokenizer: Tokenizer | None,
                   limits: ServingLimits) -> generate_pb2.TokenizeResponse:
    """Raises InvalidRequestError (or RequestLimitError) naming the field for a prompt Generate would refuse."""
    kind = request.WhichOneof("prompt")
    max_chat_messages = limits.request_limits.max_chat_messages
    if len(request.chat.messages) > max_chat_messages:
        raise RequestLimitError("prompt.chat.messages", f"at most {max_chat_messages} messages")
    add_special_tokens = request.add_special_tokens if request.HasField("add_special_tokens") else None

    def encode() -> list[int]:
        return encode_prompt(kind, request.text, [], request.chat, add_special_tokens, tokenizer, limits.vocab_size)

    large = prompt_chars(request.text, request.chat) > OFF_LOOP_PROMPT_CHARS
    token_ids = await asyncio.to_thread(encode) if large else encode()
    response = generate_pb2.TokenizeResponse(token_ids=token_ids, max_model_len=limits.max_model_len)
    if request.return_token_strs:
        response.token_strs.extend(token or "" for token in tokenizer.convert_ids_to_tokens(token_ids))
    return response


async def detokenize(request: generate_pb2.DetokenizeRequest, tokenizer: Tokenizer | None,
                     limits: ServingLimits) -> generate_pb2.DetokenizeResponse:
    """The text of the ids, special tokens kept (as vLLM's /detokenize)."""
    vocab_size = limits.vocab_size
    if tokenizer is None:
        raise InvalidRequestError("token_ids", "this model has no tokenizer")
    if any(i < 0 or i >= vocab_size for i in request.token_ids):
        raise InvalidRequestError("token_ids", f"ids must lie in [0, {vocab_size})")
    return generate_pb2.DetokenizeResponse(text=tokenizer.decode(list(request.token_ids), skip_special_tokens=False))
