"""Size limits on what one request may ask for, so that no single request can cost the others their answer.

Who owns it: the service builds one `RequestLimits` from its config (the `--max-*` flags) once the model's
context length is known, and the validator (`request_validation.py`) applies it at the gRPC edge, before the
request is tokenized or touches the engine. Range checks of each field (top_p in (0, 1], ...) stay in the
validator; this module only bounds sizes and counts.

Every refusal names the field and the limit (and the flag that sets it), never the offending value: an error
body must not echo a hostile prompt or stop string back.
"""

from __future__ import annotations

from dataclasses import dataclass

from protos.pagedserve.v1 import generate_pb2
from scheduler_svc.api.grammar_limits import GrammarLimits


class RequestLimitError(ValueError):
    """A request over a size limit; `field` is the wire field, str() is safe to send back."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field


@dataclass(frozen=True)
class RequestLimits:
    # Most prompt tokens (after tokenization or as sent); None: only max_model_len bounds it.
    max_prompt_tokens: int | None = None
    # Most sequences one request fans out to (n, best_of and beam_width each).
    max_n: int = 64
    # Largest max_tokens accepted; None: any (generation still ends at max_model_len).
    max_tokens_limit: int | None = None
    max_stop_strings: int = 32
    max_stop_string_length: int = 1024  # characters
    max_stop_token_ids: int = 256
    max_bad_words: int = 256  # each at most max_stop_string_length characters
    # Most logprobs (alternatives per token) a request may ask for; checked with the other sampling ranges
    # (request_validation.py).
    max_logprobs: int = 20
    max_chat_messages: int = 1024
    # --structured-outputs-config's disable_any_whitespace: JSON constraints of every request without it.
    json_without_whitespace: bool = False
    # What one structured-output grammar may cost (--structured-outputs-config).
    grammar_limits: GrammarLimits = GrammarLimits()


def check_wire_limits(request: generate_pb2.GenerateRequest, limits: RequestLimits) -> None:
    """Refuses a request whose fields are over a size limit, before anything is tokenized."""
    sampling = request.sampling
    if request.WhichOneof("prompt") == "token_ids" and limits.max_prompt_tokens is not None:
        check_prompt_tokens(len(request.token_ids.ids), limits)
    if len(request.chat.messages) > limits.max_chat_messages:
        raise RequestLimitError("prompt.chat.messages", f"at most {limits.max_chat_messages} messages")
    for name in ("n", "best_of", "beam_width"):
        if sampling.HasField(name) and getattr(sampling, name) > limits.max_n:
            raise RequestLimitError(f"sampling.{name}", f"at most {limits.max_n} (--max-n)")
    if limits.max_tokens_limit is not None and sampling.max_tokens > limits.max_tokens_limit:
        raise RequestLimitError("sampling.max_tokens", f"at most {limits.max_tokens_limit} (--max-tokens-limit)")
    _check_texts("sampling.stop", sampling.stop, limits.max_stop_strings, "stop strings (--max-stop-strings)",
                 "stop string", limits.max_stop_string_length)
    if len(sampling.stop_token_ids) > limits.max_stop_token_ids:
        raise RequestLimitError("sampling.stop_token_ids", f"at most {limits.max_stop_token_ids} ids")
    _check_texts("sampling.bad_words", sampling.bad_words, limits.max_bad_words, "words", "word",
                 limits.max_stop_string_length)


def _check_texts(field: str, texts, max_count: int, plural: str, noun: str, max_length: int) -> None:
    """At most `max_count` texts, each at most `max_length` characters (--max-stop-string-length's)."""
    if len(texts) > max_count:
        raise RequestLimitError(field, f"at most {max_count} {plural}")
    if any(len(text) > max_length for text in texts):
        raise RequestLimitError(field, f"each {noun} at most {max_length} characters (--max-stop-string-length)")


def check_prompt_tokens(num_tokens: int, limits: RequestLimits) -> None:
    if limits.max_prompt_tokens is not None and num_tokens > limits.max_prompt_tokens:
        raise RequestLimitError("prompt", f"at most {limits.max_prompt_tokens} tokens (--max-prompt-tokens)")
