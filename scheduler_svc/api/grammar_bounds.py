"""The checks that hold a structured-output constraint to the server's GrammarLimits before it is admitted.

Why two kinds of check: llguidance builds lazily (its lexer states and parser items grow as the output goes),
so a grammar that validates in microseconds may cost a worker seconds per mask later, or break mid-output.
What can be read from the constraint itself is checked first, cheaply: the counts of its regex repetitions
(`check_repetition`; llguidance unrolls a regex's {n,m} into lexer states as the output goes). Then the grammar
is built and its first mask computed under the same llguidance limits the workers use, timed (`try_grammar`): a
grammar that cannot be built, starts in error (a `$ref` cycle with nothing to generate), reaches a limit or
overruns the time budget is refused here, at the edge, with the limit it broke, and a worker never sees it.
"""

from __future__ import annotations

import re
import time
from typing import Any

from llguidance import LLMatcher, LLTokenizer

from scheduler_svc.api.grammar_limits import GrammarLimits
from scheduler_svc.core.validated_request import InvalidRequestError

_REGEX_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_MAX_COUNT_DIGITS = 12  # a longer count is over any limit (and int() of thousands of digits is refused)


def check_repetition(kind: str, constraint: str | Any, field: str, limits: GrammarLimits) -> None:
    """Refuses a constraint asking for a repetition counted past limits.max_repetition: `constraint` is the
    parsed JSON schema (json), the regex (regex) or the Lark/GBNF text (grammar)."""
    if kind == "json":
        _check_schema(constraint, field, limits.max_repetition)
    elif kind == "regex":
        _check_count(regex_repetition(constraint), "a {n,m} repetition (nested ones multiply)", field, limits)
    elif kind == "grammar":
        counts = [_count(match) for match in _REGEX_COUNT.finditer(constraint)]
        _check_count(max(counts, default=0), "a {n,m} repetition", field, limits)


def regex_repetition(regex: str) -> int:
    """The largest repetition count a regex asks for, counts of nested groups multiplied ((a{10}){20}: 200);
    0 without counted repetitions. Escapes and character classes are skipped; unbounded ones (*, +) count 0."""
    level_max = [0]  # per open group: the largest count inside it so far
    i = 0
    while i < len(regex):
        char = regex[i]
        if char == "(":
            level_max.append(0)
            i += 1
            continue
        if char == ")" and len(level_max) > 1:
            atom, i = max(level_max.pop(), 1), i + 1
        elif char == "\\":
            atom, i = 1, i + 2
        elif char == "[":
            atom, i = 1, _class_end(regex, i)
        else:
            atom, i = 1, i + 1
        match = _REGEX_COUNT.match(regex, i)
        if match:
            level_max[-1] = max(level_max[-1], atom * _count(match))
            i = match.end()
        elif atom > 1:  # a group's inner count, itself not repeated by a count
            level_max[-1] = max(level_max[-1], atom)
    return max(level_max)


def try_grammar(grammar: str, ll_tokenizer: LLTokenizer, field: str, limits: GrammarLimits) -> None:
    """Builds `grammar` as a worker will and computes its first mask, under the limits and within
    limits.grammar_compile_timeout_s of this thread's CPU time (llguidance works on the calling thread; CPU time,
    not wall time, so that a loaded host does not refuse a grammar it would build in time); raises
    InvalidRequestError naming what it broke."""
    started = time.thread_time()
    matcher = LLMatcher(ll_tokenizer, grammar, log_level=0, limits=limits.parser_limits())
    if not matcher.is_error():
        matcher.compute_bitmask()
    elapsed = time.thread_time() - started
    if matcher.is_error():
        reason = short_reason(matcher.get_error())
        if reason == "NoExtensionBias":  # llguidance's stop reason when no token can start the output
            reason = "it allows no output at all (e.g. a $ref cycle with nothing to generate)"
        raise InvalidRequestError(field, f"the grammar cannot be used: {reason}")
    if elapsed > limits.grammar_compile_timeout_s:
        raise InvalidRequestError(field, f"the grammar took {elapsed:.2f} s of CPU to build and start, over the server's "
                                  f"grammar_compile_timeout_s {limits.grammar_compile_timeout_s:g}")


def short_reason(engine_message: str, max_chars: int = 300) -> str:
    """llguidance's error, its first line and any `error:` line (regex errors put the cause there), cut short:
    never its parser state or the grammar (a verbose error appends them as `<state>` and `<grammar>` blocks)."""
    lines = [line.strip() for line in engine_message.strip().splitlines() if line.strip()]
    kept = lines[:1] + [line for line in lines[1:] if line.startswith("error:")]
    reason = " ".join(kept).split("<state>")[0].strip() or "the grammar's matcher stopped"
    return reason if len(reason) <= max_chars else reason[: max_chars - 3] + "..."


def _check_schema(schema: Any, field: str, max_repetition: int) -> None:
    """Every regex `pattern` of a schema, at any depth (definitions included). The count keywords (minItems,
    maxLength, ...) are not limited: llguidance counts them without unrolling, so a huge count costs what a
    small one does (docs/benchmarks.md, "Structured outputs"), and schemas with maxLength 65535 are common."""
    if isinstance(schema, list):
        for item in schema:
            _check_schema(item, field, max_repetition)
        return
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        if key == "pattern" and isinstance(value, str):
            count = regex_repetition(value)
            if count > max_repetition:
                raise InvalidRequestError(field, f"pattern asks for a repetition of {count}, over the server's "
                                          f"max_repetition {max_repetition}")
        elif isinstance(value, (dict, list)):
            _check_schema(value, field, max_repetition)


def _check_count(count: int, what: str, field: str, limits: GrammarLimits) -> None:
    if count > limits.max_repetition:
        raise InvalidRequestError(field, f"{what} of {count} is over the server's max_repetition "
                                  f"{limits.max_repetition}")


def _count(match: re.Match) -> int:
    """The largest count of a {n}, {n,} or {n,m} match (n for {n,}: what it asks for at least)."""
    digits = match.group(2) or match.group(1)
    return 10**_MAX_COUNT_DIGITS if len(digits) > _MAX_COUNT_DIGITS else int(digits)


def _class_end(regex: str, start: int) -> int:
    """The index after the `]` closing the character class opened at `start` (a leading `]` or `^]` is a
    member, escapes are skipped)."""
    i = start + 1
    if i < len(regex) and regex[i] == "^":
        i += 1
    if i < len(regex) and regex[i] == "]":
        i += 1
    while i < len(regex) and regex[i] != "]":
        i += 2 if regex[i] == "\\" else 1
    return i + 1
