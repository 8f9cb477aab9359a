"""vLLM's `--chat-template`: a file path or the template itself, turned into template text once at start-up.

Why here and not in the tokenizer loader: the value is the operator's, not the model's; it is read and
compiled when the command line is parsed, so a missing file or a Jinja syntax error stops the server before
anything loads, with a message naming the flag.
"""

from __future__ import annotations

import os

import jinja2

from scheduler_svc.text.chat_template import compile_chat_template

# A value with any of these is a template, not a path (vLLM's rule).
_TEMPLATE_CHARACTERS = frozenset("{}\n")


def chat_template_text(value: str) -> str:
    """The template `value` names: the file's text if it is a file, else `value` itself if it looks like a
    template; ValueError naming --chat-template otherwise or if Jinja cannot compile it."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as handle:
            text = handle.read()
    elif _TEMPLATE_CHARACTERS & set(value):
        text = value
    else:
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
    try:
        compile_chat_template(text)
    except jinja2.TemplateError as error:
        raise ValueError(f"--chat-template: not a valid Jinja template: {error}") from None
    return text
