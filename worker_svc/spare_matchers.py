"""Finished rows' grammar matchers, kept for new rows of the same grammar (worker_svc/grammar_matchers.py)."""

from __future__ import annotations

from collections import OrderedDict

from llguidance import LLMatcher


class SpareMatchers:
    """Finished rows' matchers by grammar, for new rows of the same grammar: a reset costs a small fraction of
    a build, which parses and compiles the grammar on one core whatever the threads (llguidance's builds
    barely run in parallel), so a plan of many new constrained requests would hold its step up (figures in
    docs/benchmarks.md, "Structured outputs"). A reset matcher is a start-state matcher of its own (a
    `deep_copy` shares its source's caches, whose lock then serializes the masks). At most `capacity` are
    kept, the least recently returned grammar's dropped first."""

    def __init__(self, capacity: int):
        self._capacity = capacity
        self._by_grammar: OrderedDict[str, list[LLMatcher]] = OrderedDict()
        self._size = 0

    def count(self, grammar: str) -> int:
        return len(self._by_grammar.get(grammar, ()))

    def put(self, grammar: str, matcher: LLMatcher) -> None:
        self._by_grammar.setdefault(grammar, []).append(matcher)
        self._by_grammar.move_to_end(grammar)
        self._size += 1
        while self._size > self._capacity:
            oldest = next(iter(self._by_grammar))
            self._by_grammar[oldest].pop(0)
            self._size -= 1
            if not self._by_grammar[oldest]:
                del self._by_grammar[oldest]

    def take(self, grammar: str) -> LLMatcher | None:
        matchers = self._by_grammar.get(grammar)
        if not matchers:
            return None
        self._size -= 1
        matcher = matchers.pop()
        if not matchers:
            del self._by_grammar[grammar]
        return matcher
