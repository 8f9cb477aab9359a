"""The scheduler's side of structured outputs (scheduler_svc/api/structured_outputs.py and request validation):
each kind of constraint becomes a grammar llguidance accepts and that accepts exactly what it should; a repeated
constraint is built once (the LRU cache); refusals name the field; beam search and a tokenizer-less server refuse
constraints; the grammar rides in the plan of every NewRequest; and the module imports no torch."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import pytest
from llguidance import LLMatcher, LLTokenizer

from protos.pagedserve.v1 import generate_pb2
from scheduler_svc.api import structured_outputs
from scheduler_svc.api.request_validation import ServingLimits, validate_request
from scheduler_svc.api.grammar_bounds import regex_repetition
from scheduler_svc.api.grammar_limits import GrammarLimits
from scheduler_svc.api.structured_outputs import structured_grammar
from scheduler_svc.config import structured_outputs_config
from scheduler_svc.core.validated_request import InvalidRequestError
from scheduler_svc.text.tokenizer_loading import load_tokenizer
from service_runtime.model_source import resolve_model

LIMITS = ServingLimits(max_model_len=256, vocab_size=49152, kv_capacity_tokens=4096)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None).path)


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer):
    return LLTokenizer(tokenizer.to_json(), eos_token=list(tokenizer.eos_token_ids))


def accepts(ll_tokenizer, tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` whole and then allows EOS (the output may end there)."""
    matcher = LLMatcher(ll_tokenizer, grammar)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.consume_tokens(ids) and matcher.is_accepting() and not matcher.is_error()


def wire(**kind) -> generate_pb2.StructuredOutputs:
    if "choice" in kind:
        kind["choice"] = generate_pb2.StringChoice(choices=kind["choice"])
    return generate_pb2.StructuredOutputs(**kind)


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"enum": ["a", "b"]}},
          "required": ["n", "s"], "additionalProperties": False}


@pytest.mark.parametrize("kind, good, bad", [
    (dict(json=json.dumps(SCHEMA)), '{"n": 3, "s": "a"}', '{"n": 3}'),
    (dict(json=json.dumps(SCHEMA), disable_any_whitespace=True), '{"n":3,"s":"b"}', '{"n": 3, "s": "b"}'),
    (dict(json_object=True), '{"x": [1, 2]}', '[1, 2]'),
    (dict(regex=r"[0-9]{3}-[a-z]+"), "123-abc", "12-abc"),
    (dict(choice=["yes", "no \"quoted\"", "a|b"]), 'no "quoted"', "maybe"),
    (dict(choice=["yes", "no \"quoted\"", "a|b"]), "a|b", "a"),
    (dict(grammar='start: "x" NUM\nNUM: /[0-9]+/'), "x42", "y42"),
    (dict(grammar='root ::= "x" num\nnum ::= [0-9]+'), "x42", "x"),  # GBNF
], ids=["json", "json-compact", "json_object", "regex", "choice-escaped", "choice-pipe", "lark", "gbnf"])
def test_each_kind_becomes_a_grammar_that_accepts_what_it_should(ll_tokenizer, tokenizer, kind, good, bad):
    grammar = structured_grammar(wire(**kind), tokenizer)
    assert accepts(ll_tokenizer, tokenizer, grammar, good)
    assert not accepts(ll_tokenizer, tokenizer, grammar, bad)


def test_no_constraint_is_an_empty_grammar(tokenizer):
    assert structured_grammar(generate_pb2.StructuredOutputs(), tokenizer) == ""


def test_a_repeated_constraint_is_built_once(tokenizer):
    schema = wire(json=json.dumps({"type": "object", "properties": {"unique_to_this_test": {"type": "string"}}}))
    before = structured_outputs._cached_grammar.cache_info()
    first, second = structured_grammar(schema, tokenizer), structured_grammar(schema, tokenizer)
    after = structured_outputs._cached_grammar.cache_info()
    assert first == second and after.misses == before.misses + 1 and after.hits == before.hits + 1
    assert after.maxsize == structured_outputs.GRAMMAR_CACHE_SIZE


@pytest.mark.parametrize("kind, field, says", [
    (dict(json="{nope"), "json", "not valid JSON"),
    (dict(json="[1]"), "json", "must be an object"),
    (dict(json=json.dumps({"type": "object", "if": {}, "then": {}})), "json", 'Unimplemented keys: ["if", "then"]'),
    (dict(json=json.dumps({"$ref": "#/nowhere"})), "json", "does not exist"),
    (dict(regex="a(b"), "regex", "unclosed group"),
    (dict(regex=""), "regex", "must not be empty"),
    (dict(choice=[]), "choice", "at least one"),
    (dict(choice=["a", ""]), "choice", "must not be empty"),
    (dict(grammar="root ::= (\"a\""), "grammar", "GBNF"),
    (dict(grammar="   "), "grammar", "must not be empty"),
    (dict(grammar='start: "a" <|no_such_token|>'), "grammar", "unknown special token"),
    (dict(json_object=False), "json_object", "must be true"),
    (dict(disable_any_whitespace=True), "disable_any_whitespace", "json"),
    (dict(regex="a", disable_any_whitespace=True), "disable_any_whitespace", "json"),
])
def test_a_bad_constraint_is_refused_naming_the_field(tokenizer, kind, field, says):
    with pytest.raises(InvalidRequestError) as refused:
        structured_grammar(wire(**kind), tokenizer)
    assert refused.value.field == f"sampling.structured_outputs.{field}"
    assert says in str(refused.value), str(refused.value)
    assert len(str(refused.value)) < 400


def _request(**sampling) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[1, 2, 3]))
    request.sampling.CopyFrom(generate_pb2.SamplingParams(**sampling))
    return request


def test_validation_puts_the_grammar_in_sampling_params(tokenizer):
    validated = validate_request(_request(structured_outputs=wire(regex="a+")), tokenizer, LIMITS)
    assert validated.sampling_params.structured_grammar == structured_grammar(wire(regex="a+"), tokenizer)
    assert validate_request(_request(), tokenizer, LIMITS).sampling_params.structured_grammar == ""


def test_beam_search_and_a_server_without_tokenizer_refuse_constraints(tokenizer):
    with pytest.raises(InvalidRequestError, match="beam search") as refused:
        validate_request(_request(beam_width=2, temperature=0.0, structured_outputs=wire(regex="a")), tokenizer, LIMITS)
    assert refused.value.field == "sampling.structured_outputs"
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        validate_request(_request(structured_outputs=wire(regex="a")), None, LIMITS)


@pytest.mark.parametrize("sampling, field", [(dict(min_tokens=2), "sampling.min_tokens"),
                                             (dict(bad_words=["x"]), "sampling.bad_words")])
def test_masks_that_could_leave_a_constrained_row_nothing_to_sample_are_refused(tokenizer, sampling, field):
    with pytest.raises(InvalidRequestError, match="structured_outputs") as refused:
        validate_request(_request(structured_outputs=wire(choice=["x"]), **sampling), tokenizer, LIMITS)
    assert refused.value.field == field


def test_the_worker_sampling_params_carry_the_grammar():
    from scheduler_svc.core.sampling_params import SamplingParams
    from scheduler_svc.core.scheduler_output import NewRequestData
    from scheduler_svc.worker_io.plan_codec import _worker_sampling

    new = NewRequestData("r", (1,), SamplingParams(seed=1, structured_grammar="GRAMMAR"), (), 0, 1)
    assert _worker_sampling(new).structured_grammar == "GRAMMAR"


def test_the_grammar_module_imports_no_torch():
    code = ("import sys; import scheduler_svc.api.structured_outputs, scheduler_svc.api.request_validation; "
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'torch or numpy imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_tokenizer_llguidance_cannot_read_refuses_constraints():
    class UnreadableTokenizer:
        eos_token_ids = (0,)

        def to_json(self) -> str:
            return '{"model": {"type": "NoSuchModel"}}'

    with pytest.raises(InvalidRequestError, match="not available for this model's tokenizer") as refused:
        structured_grammar(wire(regex="a"), UnreadableTokenizer())
    assert refused.value.field == "sampling.structured_outputs"


def test_the_servers_structured_outputs_config_takes_whitespace_out_of_every_json_constraint(tokenizer):
    """--structured-outputs-config '{"disable_any_whitespace": true}' (vLLM's): a JSON constraint's grammar is the
    one its request would get with disable_any_whitespace; a regex's is unchanged."""
    import argparse

    from scheduler_svc.api.request_limits import RequestLimits
    from scheduler_svc.config import structured_outputs_config

    compact = ServingLimits(256, 49152, 4096, RequestLimits(json_without_whitespace=True))
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})

    def grammar(limits, **kind):
        return validate_request(_request(structured_outputs=wire(**kind)), tokenizer,
                                limits).sampling_params.structured_grammar

    assert grammar(compact, json=schema) == grammar(LIMITS, json=schema, disable_any_whitespace=True)
    assert grammar(compact, json=schema) != grammar(LIMITS, json=schema)
    assert grammar(compact, regex="a+") == grammar(LIMITS, regex="a+")
    assert structured_outputs_config('{"backend": "guidance", "disable_any_whitespace": true}')
    for bad in ("[]", "{", '{"backend": "xgrammar"}', '{"disable_any_whitespace": 1}', '{"reasoning_parser": "x"}'):
        with pytest.raises(argparse.ArgumentTypeError):
            structured_outputs_config(bad)


# The probes of 2026-11-28 (each had crashed a worker, held a stream for seconds or given an empty output).
REFCYCLE = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
PROBES = [
    (dict(regex="(a{1000}){1000}"), "regex", "max_repetition 10000"),
    (dict(json=json.dumps({"type": "string", "pattern": "^(x{200}){200}$"})), "json", "max_repetition 10000"),
    (dict(grammar='start: "a"{20000}'), "grammar", "max_repetition 10000"),
    (dict(json=json.dumps(REFCYCLE)), "json", "allows no output at all"),
]


@pytest.mark.parametrize("kind, field, says", PROBES, ids=["regex", "pattern", "lark", "ref-cycle"])
def test_a_constraint_past_the_grammar_limits_is_refused_quickly_naming_the_limit(tokenizer, kind, field, says):
    structured_grammar(wire(regex="warm"), tokenizer)  # llguidance's tokenizer built once, not timed
    started = time.perf_counter()
    with pytest.raises(InvalidRequestError) as refused:
        structured_grammar(wire(**kind), tokenizer)
    assert time.perf_counter() - started < 0.5
    assert refused.value.field == f"sampling.structured_outputs.{field}" and says in str(refused.value), refused.value
    assert "<state>" not in str(refused.value) and "<grammar>" not in str(refused.value)


@pytest.mark.parametrize("schema", [{"type": "array", "items": {"type": "integer"}, "minItems": 100000},
                                    {"type": "string", "maxLength": 10**9}, {"type": "string", "maxLength": 65535}])
def test_json_count_keywords_are_not_limited_llguidance_counts_them_without_unrolling(tokenizer, schema):
    """The probes' minItems 100000 and maxLength 10**9 answered slowly because no output of max_tokens closes
    them (generation ran to its end), not because of their masks; maxLength 65535 is a common schema."""
    assert structured_grammar(wire(json=json.dumps(schema)), tokenizer)


def test_counts_within_max_repetition_pass_and_nested_regex_counts_multiply(tokenizer):
    assert regex_repetition(r"(a{1000}){1000}") == 1_000_000
    assert regex_repetition(r"[{]{3}(x|y{2,5}){4,}\{9}") == 20
    assert regex_repetition(r"[a-z]+@(x\)){7}") == 7
    structured_grammar(wire(json=json.dumps({"type": "array", "minItems": 200, "maxItems": 1000,
                                             "items": {"type": "string", "maxLength": 12}})), tokenizer)
    structured_grammar(wire(regex="(a{100}){100}"), tokenizer)


def test_a_thousand_required_tools_are_refused_by_max_grammar_size(tokenizer):
    from gateway.protocol import ToolDefinition
    from gateway.tool_choice import required_calls_schema, schema_text

    def tools(count):
        return [ToolDefinition.model_validate({"type": "function", "function": {
            "name": f"tool_{i}", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}})
            for i in range(count)]

    structured_grammar(wire(json=schema_text(required_calls_schema(tools(10)))), tokenizer)
    with pytest.raises(InvalidRequestError) as refused:
        structured_grammar(wire(json=schema_text(required_calls_schema(tools(1000)))), tokenizer)
    assert "grammar size" in str(refused.value) and "20000" in str(refused.value), refused.value


def test_the_grammar_limits_come_from_the_structured_outputs_config(tokenizer):
    options = structured_outputs_config('{"max_repetition": 50, "grammar_compile_timeout_s": 0.5}')
    limits = GrammarLimits.from_options(options)
    assert limits.max_repetition == 50 and limits.grammar_compile_timeout_s == 0.5
    assert limits.to_wire().max_grammar_size == GrammarLimits().max_grammar_size
    with pytest.raises(InvalidRequestError, match="max_repetition 50"):
        structured_grammar(wire(regex="a{51}"), tokenizer, limits)
    with pytest.raises(argparse.ArgumentTypeError, match="max_repetition"):
        structured_outputs_config('{"max_repetition": -1}')


def test_a_resumed_output_its_grammar_rejects_is_refused_at_the_edge_not_on_a_worker(tokenizer):
    def resumed(text: str) -> generate_pb2.GenerateRequest:
        request = _request(structured_outputs=wire(regex="[0-9]+ apples"), seed=3)
        request.resume.token_ids.extend(tokenizer.encode(text, add_special_tokens=False))
        return request

    assert validate_request(resumed("12 app"), tokenizer, LIMITS).resume.token_ids  # a prefix the grammar allows
    with pytest.raises(InvalidRequestError) as refused:
        validate_request(resumed("twelve"), tokenizer, LIMITS)
    assert refused.value.field == "resume.token_ids"
