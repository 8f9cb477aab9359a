"""The SDK's StructuredOutputsParams (vLLM's class and fields): each constraint, as the class, a dict keyword or
inside SamplingParams, becomes the one StructuredOutputs on the wire; a schema dict travels as JSON text; two
constraints at once are refused before anything is sent; SamplingParams holding one stays hashable; and the
offline LLM passes it through (`SamplingParams(structured_outputs=...)`, as with vLLM)."""

from __future__ import annotations

import json

import pytest

from client import SamplingParams, StructuredOutputsParams
from client.request_builder import build_generate_request
from pagedserve import LLM
from pagedserve import StructuredOutputsParams as TopLevelStructuredOutputsParams
from pagedserve.testing.tiny_models import add_embedded_tokenizer, make_tiny_model

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.mark.parametrize("params, wire", [
    (StructuredOutputsParams(json=SCHEMA), {"json": json.dumps(SCHEMA)}),
    (StructuredOutputsParams(json='{"type": "object"}', disable_any_whitespace=True),
     {"json": '{"type": "object"}', "disable_any_whitespace": True}),
    (StructuredOutputsParams(regex="a+"), {"regex": "a+"}),
    (StructuredOutputsParams(choice=["x", "y"]), {"choice": {"choices": ["x", "y"]}}),
    (StructuredOutputsParams(grammar='root ::= "a"'), {"grammar": 'root ::= "a"'}),
    (StructuredOutputsParams(json_object=True), {"json_object": True}),
    ({"regex": "b+"}, {"regex": "b+"}),
])
def test_each_constraint_becomes_its_wire_message(params, wire):
    from google.protobuf import json_format

    request = build_generate_request("hi", structured_outputs=params)
    assert json_format.MessageToDict(request.sampling.structured_outputs, preserving_proto_field_name=True) == wire


def test_an_empty_choice_still_reaches_the_server_as_a_choice():
    request = build_generate_request("hi", structured_outputs=StructuredOutputsParams(choice=[]))
    assert request.sampling.structured_outputs.WhichOneof("kind") == "choice"


def test_two_constraints_or_unknown_fields_are_refused_before_sending():
    with pytest.raises(ValueError, match="json and regex"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(TypeError, match="whitespace_pattern"):
        build_generate_request("hi", structured_outputs={"regex": "a", "whitespace_pattern": " "})


def test_sampling_params_carry_it_and_stay_hashable():
    params = SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(json=SCHEMA, choice=None))
    hash(params)
    request = build_generate_request("hi", **params.keywords())
    assert json.loads(request.sampling.structured_outputs.json) == SCHEMA
    assert TopLevelStructuredOutputsParams is StructuredOutputsParams


def test_the_offline_llm_constrains_its_outputs(tmp_path):
    model = add_embedded_tokenizer(make_tiny_model(tmp_path, "llama", seed=3, vocab_size=49216, eos_token_id=2))
    params = SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    with LLM(model=str(model), max_model_len=256, num_kv_blocks=64) as offline:
        (result,) = offline.generate(["Is it?"], params, use_tqdm=False)
    for output in result.outputs:
        assert output.finish_reason == "stop" and json.loads(output.text) in ({"ok": True}, {"ok": False})


def test_the_command_line_sends_json_schema_regex_or_choice(tmp_path, capsys):
    from client.cli import main
    from tests.fake_generation_server import FakeServer

    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    fake = FakeServer()
    try:
        server = fake.reset()
        assert main(["hi", "--target", fake.target, "--json-schema", str(schema_file)]) == 0
        assert main(["hi", "--target", fake.target, "--regex", "a+"]) == 0
        assert main(["hi", "--target", fake.target, "--choice", "yes", "no"]) == 0
        sent = [request.sampling.structured_outputs for request in server.requests]
        assert json.loads(sent[0].json) == SCHEMA and sent[1].regex == "a+"
        assert list(sent[2].choice.choices) == ["yes", "no"]
        assert main(["hi", "--target", fake.target, "--json-schema", str(tmp_path / "missing.json")]) == 2
    finally:
        fake.stop()
