"""POST /tokenize and /detokenize, vLLM's: the served model's tokenizer over HTTP (the scheduler's Tokenize
and Detokenize RPCs; the gateway itself has no tokenizer).

/tokenize takes a text (`prompt`) or a chat (`messages`, with the chat options of /v1/chat/completions) and
returns the ids a generation of it would read: {count, max_model_len, tokens, token_strs}. /detokenize takes
{tokens} and returns {prompt}, special tokens included.
"""

from __future__ import annotations

from gateway.backend import Backend
from gateway.errors import invalid_request
from gateway.protocol import DetokenizeRequest, TokenizeRequest
from gateway.refused_fields import refuse_unserved
from gateway.sampling import chat_messages, chat_options


async def tokenize(body: TokenizeRequest, backend: Backend) -> dict:
    await backend.model_for(body.model)
    refuse_unserved(body)
    if (body.prompt is None) == (body.messages is None):
        raise invalid_request("prompt: send exactly one of prompt and messages", "prompt")
    if body.prompt is not None:
        result = await backend.client.tokenize(body.prompt, add_special_tokens=body.add_special_tokens,
                                               return_token_strs=body.return_token_strs)
    else:
        result = await backend.client.tokenize(messages=chat_messages(body.messages),
                                               add_special_tokens=body.add_special_tokens,
                                               return_token_strs=body.return_token_strs, **chat_options(body))
    return {"count": result.count, "max_model_len": result.max_model_len, "tokens": result.token_ids,
            "token_strs": result.token_strs}


async def detokenize(body: DetokenizeRequest, backend: Backend) -> dict:
    await backend.model_for(body.model)
    try:
        text = await backend.client.detokenize(body.tokens)
    except ValueError as error:  # an id past int32, which the wire cannot carry
        raise invalid_request("tokens: ids must be 32-bit integers", "tokens") from error
    return {"prompt": text}
