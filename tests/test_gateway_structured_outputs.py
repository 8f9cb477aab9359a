"""The gateway's constrained-decoding fields against the in-process stand-in for the scheduler: response_format
(json_object, json_schema), vLLM's structured_outputs extra body field and the older guided_* fields reach the
scheduler as the one StructuredOutputs they mean, on both generation endpoints and through the openai package;
two constraints at once, a custom whitespace pattern, another engine's name and malformed shapes are 400s naming
the field, and never reach the scheduler."""

from __future__ import annotations

import json

import openai
import pytest
from google.protobuf import json_format

from pagedserve.testing.server_harness import http_json, running_gateway

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def gateway_url(fake_server, tmp_path_factory):
    with running_gateway(tmp_path_factory.mktemp("logs"), fake_server.target, "--api-key", API_KEY) as url:
        yield url


def post(gateway_url: str, path: str, body):
    return http_json(f"{gateway_url}{path}", body, AUTH)


def sent_constraint(fake) -> dict:
    (request,) = fake.requests
    return json_format.MessageToDict(request.sampling.structured_outputs, preserving_proto_field_name=True)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("fields, expected", [
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     {"json": json.dumps(SCHEMA)}),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     {"json": json.dumps(SCHEMA), "disable_any_whitespace": True}),
    ({"structured_outputs": {"regex": "[a-z]+"}}, {"regex": "[a-z]+"}),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": {"choices": ["yes", "no"]}}),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, {"grammar": 'root ::= "a"'}),
    ({"guided_json": SCHEMA}, {"json": json.dumps(SCHEMA)}),
    ({"guided_json": json.dumps(SCHEMA)}, {"json": json.dumps(SCHEMA)}),
    ({"guided_regex": "[0-9]{3}"}, {"regex": "[0-9]{3}"}),
    ({"guided_choice": ["a", "b c"]}, {"choice": {"choices": ["a", "b c"]}}),
    ({"guided_grammar": "start: \"x\""}, {"grammar": "start: \"x\""}),
    ({"guided_regex": "x", "guided_decoding_backend": "guidance"}, {"regex": "x"}),
], ids=["json_object", "json_schema", "so-json", "so-regex", "so-choice", "so-grammar", "guided_json",
        "guided_json-text", "guided_regex", "guided_choice", "guided_grammar", "backend-guidance"])
def test_each_constraint_field_reaches_the_scheduler_as_its_structured_outputs(fake, gateway_url, path, fields,
                                                                              expected):
    body = {"prompt": "hi"} if path == "/v1/completions" else dict(CHAT)
    status, _, reply = post(gateway_url, path, {**body, **fields})
    assert status == 200, reply
    assert sent_constraint(fake) == expected


def test_response_format_text_asks_for_nothing(fake, gateway_url):
    status, _, reply = post(gateway_url, "/v1/chat/completions", {**CHAT, "response_format": {"type": "text"}})
    assert status == 200, reply
    assert not fake.requests[0].sampling.HasField("structured_outputs")


def test_the_openai_package_sends_a_json_schema_response_format_and_extra_body_fields(fake, gateway_url):
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=API_KEY, max_retries=0) as api:
        api.chat.completions.create(model="fake-model", messages=CHAT["messages"], response_format={
            "type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}})
        api.completions.create(model="fake-model", prompt="hi", extra_body={"guided_choice": ["up", "down"]})
    first, second = fake.requests
    assert json.loads(first.sampling.structured_outputs.json) == SCHEMA
    assert list(second.sampling.structured_outputs.choice.choices) == ["up", "down"]


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "x"}, "guided_regex"),
    ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "x"}}, "structured_outputs.json"),
    ({"guided_regex": "x", "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
    ({"guided_regex": "x", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ({"response_format": {"type": "grammar"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "bogus": 1}}}, "response_format"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": "json"}, "structured_outputs"),
    ({"guided_choice": "a"}, "guided_choice"),
    ({"guided_json": 3}, "guided_json"),
    ({"guided_regex": ["x"]}, "guided_regex"),
], ids=["format-and-guided", "two-guided", "two-kinds", "whitespace-pattern", "other-engine", "format-type",
        "no-json_schema", "json_schema-key", "so-unknown", "so-not-object", "choice-not-list", "json-not-object",
        "regex-not-string"])
def test_bad_constraint_fields_are_400s_naming_the_field_and_never_reach_the_scheduler(fake, gateway_url, fields,
                                                                                      param):
    status, _, reply = post(gateway_url, "/v1/chat/completions", {**CHAT, **fields})
    assert status == 400, reply
    assert reply["error"]["param"] == param
    if "give one" in reply["error"]["message"]:
        assert all(name.split(".")[0] in reply["error"]["message"] for name in fields)
    assert fake.requests == []
