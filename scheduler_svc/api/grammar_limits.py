"""The bounds on what one structured-output grammar may cost: the server's single, frozen declaration of them.

Why here and why one object: the scheduler builds and tries every grammar under these limits before admitting it
(structured_outputs.py), and sends the llguidance ones to the workers at setup (WorkerSetup.structured_output_limits)
so that their matchers run under the very limits the grammar was tried with: a grammar that passed here cannot
cost a worker more per mask or per advance than the limits allow, and one that reaches a limit mid-output ends
its own request (StepResult.failed_requests), not the worker. Set with --structured-outputs-config (its keys are
these fields' names; the other keys are vLLM's).

The defaults (each grammar the tests and benchmarks use passes them with a wide margin):
- max_repetition 10,000: the largest count a regex's {n,m} may ask for, in a regex constraint, a JSON schema's
  `pattern` or a Lark/GBNF grammar (nested counts multiply: (a{1000}){1000} is 1,000,000). JSON schema count
  keywords (minItems, maxLength, ...) are not limited: llguidance counts those without unrolling. llguidance
  unrolls counted repetitions into lexer states as the output goes; a count
  of a million costs one mask a long stall of a core and then breaks the lexer ("too many expressions"; figures
  in docs/benchmarks.md, "Structured outputs"), and a count far past any context length constrains nothing an
  output could reach. pagedserve's own limit.
- max_grammar_size 20,000 (llguidance's default 500,000): symbols in the grammar's productions; about
  30 per simple tool, so tool_choice "required" takes some 600 tools, while 1,000 tools build slowly and
  give an empty output.
- max_items_in_row, initial_lexer_fuel, step_lexer_fuel, step_max_items, max_lexer_states: llguidance's
  (2,000; 1,000,000; 200,000; 50,000 Earley items; 250,000 lexer states), each bounding the work of a build or
  a mask to milliseconds, written out so that the workers use them explicitly.
- grammar_compile_timeout_s 1.0: the scheduler's build of a grammar and its first mask, timed; a grammar
  over it is refused (the work is bounded by the limits above; this bounds what they let through).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from protos.pagedserve.v1 import worker_pb2

# llguidance's ParserLimits fields, as WorkerSetup.StructuredOutputLimits carries them.
_PARSER_FIELDS = ("max_items_in_row", "initial_lexer_fuel", "step_lexer_fuel", "step_max_items", "max_lexer_states",
                  "max_grammar_size")


@dataclass(frozen=True)
class GrammarLimits:
    max_repetition: int = 10_000
    max_grammar_size: int = 20_000
    max_items_in_row: int = 2_000
    initial_lexer_fuel: int = 1_000_000
    step_lexer_fuel: int = 200_000
    step_max_items: int = 50_000
    max_lexer_states: int = 250_000
    grammar_compile_timeout_s: float = 1.0

    def to_wire(self) -> worker_pb2.StructuredOutputLimits:
        return worker_pb2.StructuredOutputLimits(**{name: getattr(self, name) for name in _PARSER_FIELDS})

    def parser_limits(self):
        """llguidance's LLParserLimits of these limits, with its verbose errors off: an error then names the
        limit without the parser's state and the grammar, which clients must not see (the workers build theirs
        from `to_wire` the same way). Imported here: the config module that declares the limits loads no
        llguidance."""
        from llguidance import LLParserLimits

        return LLParserLimits(**{name: getattr(self, name) for name in _PARSER_FIELDS}, verbose_errors=False)

    @staticmethod
    def from_options(options: dict[str, Any]) -> GrammarLimits:
        """The limits of --structured-outputs-config's keys named after a field (the rest are not ours);
        raises argparse.ArgumentTypeError for a value that is not a positive number."""
        values = {}
        for limit in dataclasses.fields(GrammarLimits):
            if limit.name not in options:
                continue
            value = options[limit.name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or (
                    limit.type == "int" and not isinstance(value, int)):
                raise argparse.ArgumentTypeError(f"{limit.name} must be a positive {limit.type}")
            values[limit.name] = value
        return GrammarLimits(**values)
