"""The prompt forms vLLM's offline API accepts, reduced to what the SDK sends: text or token ids.

vLLM takes a text, token ids, a TextPrompt dict {"prompt": text} or a TokensPrompt dict {"prompt_token_ids":
ids}, alone or in a list. Anything a dict may carry beyond that (multi_modal_data, mm_processor_kwargs,
prompt_embeds, ...) is refused by name, never dropped: a caller must not get output for a prompt we did not
read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Prompt = str | Sequence[int] | Mapping[str, Any]
Conversation = Sequence[Mapping[str, str]]


def prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt or a list of them, as a list."""
    if isinstance(prompts, (str, Mapping)) or (isinstance(prompts, Sequence) and prompts
                                               and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def prompt_of(prompt: Prompt) -> str | list[int]:
    """The text or token ids of one prompt in any of vLLM's forms; ValueError naming what is not supported."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        unsupported = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
        if unsupported:
            raise ValueError(f"prompt keys {unsupported} are not supported (a prompt dict holds 'prompt' or "
                             "'prompt_token_ids')")
        if len(prompt) != 1:
            raise ValueError("a prompt dict holds exactly one of 'prompt' (text) and 'prompt_token_ids'")
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise ValueError("'prompt' in a prompt dict is text; token ids go in 'prompt_token_ids'")
            return prompt["prompt"]
        return prompt_of(list(prompt["prompt_token_ids"]))
    if isinstance(prompt, Sequence) and all(isinstance(token, int) for token in prompt):
        return list(prompt)
    raise ValueError(f"a prompt is text, token ids or a prompt dict, not {type(prompt).__name__}")


def conversation_list(messages: Conversation | Sequence[Conversation]) -> list[Conversation]:
    """One conversation (a list of messages) or a list of them, as a list."""
    if messages and isinstance(messages[0], Mapping):
        return [messages]
    return list(messages)
