"""A request's StructuredOutputs (JSON schema, any JSON object, regex, choice, grammar) as the llguidance grammar
the workers constrain its rows with, or a refusal naming the field.

Why llguidance, and why here: its grammar compilers and validator have no torch dependency, so the torch-free
scheduler builds and checks every constraint at the gRPC edge, where a bad one costs nobody else anything, and
the workers receive a grammar already known to be valid (WorkerSamplingParams.structured_grammar). Building is
lazy on llguidance's side (the lexer and parser tables grow as tokens come), so a big schema costs milliseconds
here, not a precompute over the vocabulary; for that reason each grammar is also built once more the way a
worker will and its first mask computed, under the server's GrammarLimits and time budget (grammar_bounds.py), so
that what a worker receives has bounded work per mask. The grpc layer calls this off the event loop (llguidance drops the
GIL while it validates) and a bounded LRU cache keyed by the constraint's bytes builds a repeated schema once.

What each kind becomes (vLLM's meanings): json -> llguidance's JSON-schema grammar (whitespace between tokens
allowed unless disable_any_whitespace or the schema's own llguidance options, "x-guidance": {"whitespace_flexible":
false}, say otherwise; an unimplemented keyword is refused, not ignored); json_object -> the
schema {"type": "object"}; regex -> a regex grammar (Rust regex syntax: no look-around or back-references);
choice -> an alternation of the strings as literals; grammar -> Lark as llguidance reads it, or GBNF (`::=`
rules, as llama.cpp and vLLM accept), converted to Lark by llguidance's own converter.
"""

from __future__ import annotations

import json
from functools import lru_cache

from llguidance import LLMatcher, LLTokenizer
from llguidance.gbnf_to_lark import any_to_lark

from protos.pagedserve.v1 import generate_pb2
from scheduler_svc.api.grammar_bounds import check_repetition, short_reason, try_grammar
from scheduler_svc.api.grammar_limits import GrammarLimits
from scheduler_svc.core.validated_request import InvalidRequestError
from scheduler_svc.text.tokenizer import Tokenizer

FIELD = "sampling.structured_outputs"
# Distinct constraints whose grammars are kept; a grammar is about as large as its schema.
GRAMMAR_CACHE_SIZE = 256


def structured_grammar(wire: generate_pb2.StructuredOutputs, tokenizer: Tokenizer,
                       limits: GrammarLimits = GrammarLimits()) -> str:
    """The llguidance grammar of a request's constraint, validated against the model's tokenizer (a grammar
    naming a special token it lacks would fail in the workers) and held to `limits`; "" for none. Raises
    InvalidRequestError."""
    if wire.WhichOneof("kind") is None:
        if wire.disable_any_whitespace:
            raise InvalidRequestError(f"{FIELD}.disable_any_whitespace", "applies to json or json_object only")
        return ""
    return _cached_grammar(wire.SerializeToString(deterministic=True), tokenizer, limits)


def grammar_start_token_id(wire: generate_pb2.StructuredOutputs, tokenizer: Tokenizer,
                           prompt_token_ids: list[int]) -> int | None:
    """The token after which the constraint applies (reasoning_end, a reasoning model's `</think>`), or None
    when it applies from the first token: none given, or the prompt already holds it (the thought ended there:
    Qwen3's template with thinking off writes `<think></think>`; vLLM's reasoning parsers read it the same way).
    Raises InvalidRequestError when the marker is not exactly one token."""
    if not wire.reasoning_end:
        return None
    ids = tokenizer.encode(wire.reasoning_end, add_special_tokens=False)
    if len(ids) != 1:
        raise InvalidRequestError(f"{FIELD}.reasoning_end", f"must be one token of the model's tokenizer "
                                  f"(it encodes to {len(ids)})")
    return None if ids[0] in prompt_token_ids else ids[0]


def check_resumed_output(grammar: str, after_token_id: int | None, token_ids: tuple[int, ...], tokenizer: Tokenizer,
                         limits: GrammarLimits) -> None:
    """Refuses (InvalidRequestError naming resume.token_ids) a resumed output that `grammar` rejects. Why: the
    workers' matchers consume a resumed row's output when it is added, and the tokens of a resume come from
    the client; one the grammar rejects must be a refusal here, not a failure on the worker. With
    `after_token_id` (reasoning_end), only the output after its first occurrence is constrained."""
    output = list(token_ids)
    if after_token_id is not None:
        output = output[output.index(after_token_id) + 1:] if after_token_id in output else []
    if not output:
        return
    matcher = LLMatcher(_grammar_tokenizer(tokenizer), grammar, log_level=0, limits=limits.parser_limits())
    if not matcher.consume_tokens(output):
        raise InvalidRequestError("resume.token_ids", "the request's structured_outputs constraint rejects them")


@lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _cached_grammar(key: bytes, tokenizer: Tokenizer, limits: GrammarLimits) -> str:
    """Built once per distinct constraint; refusals are not cached (they raise) and cost a rebuild."""
    return _build_grammar(generate_pb2.StructuredOutputs.FromString(key), _grammar_tokenizer(tokenizer), limits)


@lru_cache(maxsize=2)
def _grammar_tokenizer(tokenizer: Tokenizer) -> LLTokenizer:
    """llguidance's view of the served tokenizer (about half a second to build, once, at the first constraint):
    what the workers will build from the same JSON. A tokenizer llguidance cannot read refuses constraints."""
    try:
        return LLTokenizer(tokenizer.to_json(), eos_token=list(tokenizer.eos_token_ids) or None)
    except Exception as error:  # its ValueError for a tokenizer model or decoder it does not support
        raise InvalidRequestError(FIELD, f"not available for this model's tokenizer ({short_reason(str(error))})") from None


def _build_grammar(wire: generate_pb2.StructuredOutputs, ll_tokenizer: LLTokenizer, limits: GrammarLimits) -> str:
    kind = wire.WhichOneof("kind")
    field = f"{FIELD}.{kind}"
    if wire.disable_any_whitespace and kind not in ("json", "json_object"):
        raise InvalidRequestError(f"{FIELD}.disable_any_whitespace", "applies to json or json_object only")
    if kind == "json":
        grammar = _json_schema_grammar(wire.json, wire.disable_any_whitespace, field, limits)
    elif kind == "json_object":
        if not wire.json_object:
            raise InvalidRequestError(field, "must be true when given")
        grammar = _json_schema_grammar('{"type": "object"}', wire.disable_any_whitespace, field, limits)
    elif kind == "regex":
        if not wire.regex:
            raise InvalidRequestError(field, "must not be empty")
        check_repetition(kind, wire.regex, field, limits)
        grammar = LLMatcher.grammar_from_regex(wire.regex)
    elif kind == "choice":
        choices = list(wire.choice.choices)
        if not choices:
            raise InvalidRequestError(field, "must list at least one string")
        if any(not choice for choice in choices):
            raise InvalidRequestError(field, "strings must not be empty")
        # JSON string literals are Lark string literals (llguidance's own "choice" format does the same).
        grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(choice) for choice in choices))
    else:
        check_repetition(kind, wire.grammar, field, limits)
        grammar = LLMatcher.grammar_from_lark(_lark_of(wire.grammar, field))
    error = LLMatcher.validate_grammar(grammar, ll_tokenizer, limits=limits.parser_limits())
    if error:
        raise InvalidRequestError(field, short_reason(error))
    try_grammar(grammar, ll_tokenizer, field, limits)
    return grammar


def _json_schema_grammar(schema_text: str, disable_any_whitespace: bool, field: str, limits: GrammarLimits) -> str:
    try:
        schema = json.loads(schema_text)
    except ValueError as error:
        raise InvalidRequestError(field, f"not valid JSON ({error})") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError(field, "a JSON schema must be an object (or true/false)")
    check_repetition("json", schema, field, limits)
    # Free whitespace by default (vLLM's), which a schema's own "x-guidance" options may turn off;
    # disable_any_whitespace overrides them.
    try:
        if disable_any_whitespace:
            return LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": False})
        return LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": True})
    except ValueError as error:
        raise InvalidRequestError(field, short_reason(str(error))) from None


def _lark_of(grammar: str, field: str) -> str:
    if not grammar.strip():
        raise InvalidRequestError(field, "must not be empty")
    try:
        return any_to_lark(grammar)  # Lark as is; GBNF (`root ::= ...`) converted
    except Exception as error:  # the converter's GbnfToLarkError and its parse errors
        raise InvalidRequestError(field, f"not a valid GBNF grammar: {short_reason(str(error))}") from None
