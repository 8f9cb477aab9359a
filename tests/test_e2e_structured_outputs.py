"""Structured outputs end to end through the real processes, on a tiny random Llama that carries a real tokenizer
(SmolLM2's, 49152 tokens, in a vocabulary padded to 49216): at temperature 1 with n = 8 every output of a nested
JSON schema parses, validates against it (jsonschema) and ends with EOS; regex, choice and GBNF grammar outputs
match; a stop string still cuts a constrained output; the same through the OpenAI gateway (response_format
json_schema); bad constraints are INVALID_ARGUMENT / 400 naming the field, and the server keeps serving. Random
weights never close a JSON object on their own: only the grammar (maxLength, maxItems, enums, no free whitespace)
brings these outputs to their end."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from client import InvalidRequestError, StructuredOutputsParams
from pagedserve.testing.server_harness import http_json, running_server
from pagedserve.testing.tiny_models import add_embedded_tokenizer, make_tiny_model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}, "zip": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
# The schema's own llguidance option: no free whitespace (the OpenAI request has no field for it).
COMPACT_PERSON = {**PERSON, "x-guidance": {"whitespace_flexible": False}}
EMAIL = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
CHOICES = ["yes", "no", "maybe so"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=3, vocab_size=49216, eos_token_id=2)
    return add_embedded_tokenizer(model_dir)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    # No free whitespace in JSON constraints unless asked (vLLM's server option): a forced tool choice's schema
    # is the gateway's, so the test cannot add it per request.
    with running_server(tmp_path_factory.mktemp("logs"), "--model", str(model), "--max-model-len", "512",
                        "--structured-outputs-config", '{"disable_any_whitespace": true}', http=True) as running:
        yield running


pytestmark = pytest.mark.usefixtures("no_block_leaks")


def test_every_sampled_output_of_a_nested_schema_regex_and_choice_is_valid_and_complete(server):
    """One batch: the three constraints share steps (n = 8 JSON, n = 4 regex, n = 4 choice), all at temperature 1."""
    asks = [dict(n=8, max_tokens=200, structured_outputs=StructuredOutputsParams(json=PERSON,
                                                                                 disable_any_whitespace=True)),
            dict(n=4, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=EMAIL)),
            dict(n=4, max_tokens=10, structured_outputs=StructuredOutputsParams(choice=CHOICES))]
    with server.client() as client, ThreadPoolExecutor(len(asks)) as pool:
        people, emails, choices = pool.map(lambda ask: client.generate("Tell me", temperature=1.0, seed=7, **ask), asks)
    assert len(people.outputs) == 8 and len({o.text for o in people.outputs}) > 1
    for output in people.outputs:
        assert output.finish_reason == "stop", output.text
        jsonschema.validate(json.loads(output.text), PERSON)
    for output in emails.outputs:
        assert output.finish_reason == "stop" and re.fullmatch(EMAIL, output.text), output.text
    for output in choices.outputs:
        assert output.finish_reason == "stop" and output.text in CHOICES


def test_a_gbnf_grammar_constrains_every_sample(server):
    with server.client() as client:
        grammar = client.generate("x", temperature=1.0, seed=3, max_tokens=20, n=3,
                                  structured_outputs=dict(grammar='root ::= "ab" [0-9] [0-9]? "!"'))
    for output in grammar.outputs:
        assert output.finish_reason == "stop" and re.fullmatch(r"ab[0-9][0-9]?!", output.text), output.text


def test_a_stop_string_ends_a_constrained_output_before_the_constraint_does(server):
    with server.client() as client:
        cut = client.generate("x", temperature=0.0, max_tokens=10, stop=[" please"],
                              structured_outputs=dict(choice=["yes please"]))
    assert cut.text == "yes" and cut.finish_reason == "stop"


BAD = [
    (dict(json="{not json"), "sampling.structured_outputs.json", "not valid JSON"),
    (dict(json=json.dumps({"type": "array", "uniqueItems": True})), "sampling.structured_outputs.json", "uniqueItems"),
    (dict(json=json.dumps({"type": "objectt"})), "sampling.structured_outputs.json", "objectt"),
    (dict(regex="a(b"), "sampling.structured_outputs.regex", "unclosed group"),
    (dict(regex="(?=a)b"), "sampling.structured_outputs.regex", "look-around"),
    (dict(choice=[]), "sampling.structured_outputs.choice", "at least one"),
    (dict(grammar="root ::= ("), "sampling.structured_outputs.grammar", "GBNF"),
    (dict(grammar="start: missing_rule"), "sampling.structured_outputs.grammar", "unknown name"),
    (dict(regex="[a-z]+", disable_any_whitespace=True), "sampling.structured_outputs.disable_any_whitespace",
     "json"),
]


@pytest.mark.parametrize("constraint, field, says", BAD,
                         ids=[case[1].rsplit(".", 1)[1] + "-" + case[2] for case in BAD])
def test_a_bad_constraint_is_invalid_argument_naming_the_field_and_the_server_keeps_serving(server, constraint,
                                                                                            field, says):
    with server.client() as client:
        with pytest.raises(InvalidRequestError) as refused:
            client.generate("x", max_tokens=4, structured_outputs=constraint)
        assert refused.value.details.startswith(f"{field}:") and says in refused.value.details, refused.value.details
        assert client.generate("x", max_tokens=4, structured_outputs=dict(choice=["ok"])).text == "ok"


def test_beam_search_with_a_constraint_is_refused(server):
    with server.client() as client, pytest.raises(InvalidRequestError, match="sampling.structured_outputs: .*beam"):
        client.generate("x", max_tokens=4, beam_width=2, temperature=0.0, structured_outputs=dict(regex="a+"))


def test_openai_response_format_json_schema_validates_and_bad_schema_is_a_400(server):
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0) as api:
        reply = api.chat.completions.create(
            model=api.models.list().data[0].id, messages=[{"role": "user", "content": "Who?"}], max_tokens=200,
            seed=1, temperature=1.0, response_format={"type": "json_schema", "json_schema": {
                "name": "person", "schema": COMPACT_PERSON, "strict": True}})
        for choice in reply.choices:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), PERSON)
    status, _, body = http_json(f"{server.http_url}/v1/completions",
                                {"prompt": "x", "max_tokens": 4, "guided_regex": "a(b"})
    assert status == 400 and body["error"]["param"] == "structured_outputs.regex", body


WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}}},
]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named_give_calls_whose_arguments_validate(server, stream):
    """The forced choices' JSON-schema constraint (the gateway builds it, the workers' grammar enforces it) on a
    random model at temperature 1: every call names a tool and its arguments validate against that tool's
    parameters, whole and streamed (the openai package reassembles the streamed calls)."""
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in WEATHER_TOOLS}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0) as api:
        for tool_choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
            ask = dict(model=api.models.list().data[0].id, messages=messages, tools=WEATHER_TOOLS, tool_choice=tool_choice,
                       temperature=1.0, seed=5, max_tokens=300)
            if stream:
                with api.chat.completions.stream(**ask) as events:
                    completion = events.get_final_completion()
            else:
                completion = api.chat.completions.create(**ask)
            choice = completion.choices[0]
            assert choice.finish_reason == "tool_calls", choice.message
            calls = choice.message.tool_calls
            assert calls and all(call.id for call in calls)
            for call in calls:
                if tool_choice != "required":
                    assert call.function.name == "get_time"
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_a_regex_past_the_grammar_limits_is_a_400_and_the_server_keeps_serving(server):
    """The probe that crashed a worker on 2026-11-28 ((a{1000}){1000}: a lexer error while sampling)."""
    status, _, body = http_json(f"{server.http_url}/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                                 "guided_regex": "(a{1000}){1000}"})
    assert status == 400 and "max_repetition" in body["error"]["message"], body
    assert "<state>" not in body["error"]["message"]
    status, _, body = http_json(f"{server.http_url}/v1/completions",
                                {"prompt": "x", "max_tokens": 4, "guided_choice": ["fine"]})
    assert status == 200 and body["choices"][0]["text"] == "fine", body


def test_a_grammar_that_fails_while_sampling_ends_its_request_alone_and_no_worker_restarts(model, tmp_path):
    """With step_max_items 200 this schema's first mask (checked at the edge) fits but the masks inside its array
    do not: the worker reports the request failed (StepResult.failed_requests), the scheduler ends it with
    INTERNAL, and the other stream, the worker and the server go on."""
    from client import PagedServeError
    from tests.stream_watch import StreamWatch

    schema = {"type": "array", "items": {"type": "object",
                                         "properties": {f"k{i}": {"type": "integer"} for i in range(30)}}}
    config = '{"disable_any_whitespace": true, "step_max_items": 200}'
    with running_server(tmp_path, "--model", str(model), "--max-model-len", "512",
                        "--structured-outputs-config", config) as server:
        other = StreamWatch(server.target, [1, 2, 3], max_tokens=64, ignore_eos=True, temperature=0.0)
        with server.client() as client:
            with pytest.raises(PagedServeError) as failed:
                client.generate([5, 6, 7], max_tokens=32, temperature=0.0,
                                structured_outputs=StructuredOutputsParams(json=schema))
            other.join(timeout=120)
            assert other.error is None and other.num_tokens == 64
            assert len(client.generate([5, 6, 7], max_tokens=8, temperature=0.0).token_ids) == 8
        log = server.log()
    assert failed.value.code.name == "INTERNAL" and "structured output failed" in failed.value.details
    assert "Too many items" in failed.value.details and "<state>" not in failed.value.details
    assert "restarting" not in log and "Traceback" not in log
