"""Tool calling and reasoning on /v1/chat/completions against the in-process stand-in for the scheduler, whose
chat output the tests script: the tools and the conversation's tool calls reach the scheduler's request; a
forced tool choice sends vLLM's JSON schema as the request's structured_outputs; the model's text becomes
tool calls (whole, and streamed as deltas the `openai` package reassembles) with finish_reason "tool_calls";
the thought goes to reasoning_content; bad tools and tool choices are 400s naming the field."""

from __future__ import annotations

import json

import openai
import pytest

from pagedserve.cli import parse_args
from pagedserve.testing.server_harness import http_json, running_gateway

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
HERMES_CALL = ["<think>", "Need the", " weather.", "</think>", "Checking.", "<tool_call>", '\n{"name": "get_',
               'weather", "arguments": {"city":', ' "Paris"}}\n', "</tool_call>"]


@pytest.fixture(scope="module")
def gateway_url(fake_server, tmp_path_factory):
    with running_gateway(tmp_path_factory.mktemp("logs"), fake_server.target, "--enable-auto-tool-choice",
                         "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3") as url:
        yield url


@pytest.fixture(scope="module")
def plain_gateway_url(fake_server, tmp_path_factory):
    with running_gateway(tmp_path_factory.mktemp("logs"), fake_server.target) as url:
        yield url


@pytest.fixture
def api(gateway_url):
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="none", max_retries=0) as client:
        yield client


def chat(url: str, **body) -> tuple[int, dict]:
    status, _, reply = http_json(f"{url}/v1/chat/completions", {"messages": ASK, **body})
    return status, reply


def test_tools_and_the_conversations_calls_reach_the_scheduler(fake, gateway_url):
    conversation = [*ASK, {"role": "assistant", "content": None, "reasoning_content": "Look it up.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    status, reply = chat(gateway_url, messages=conversation, tools=TOOLS, tool_choice="none")
    assert status == 200, reply
    prompt = fake.requests[0].chat
    assert json.loads(prompt.tools_json) == TOOLS
    assistant, tool = prompt.messages[1], prompt.messages[2]
    assert not assistant.HasField("content") and assistant.tool_calls[0].name == "get_weather"
    assert assistant.reasoning_content == "Look it up."
    assert json.loads(assistant.tool_calls[0].arguments) == {"city": "Paris"} and assistant.tool_calls[0].id == "call_1"
    assert tool.role == "tool" and tool.tool_call_id == "call_1" and tool.content == "sunny"
    assert not fake.requests[0].sampling.HasField("structured_outputs")  # "none": nothing forced


def test_auto_reads_the_models_tool_calls_and_thought(fake, gateway_url):
    fake.script = HERMES_CALL
    status, reply = chat(gateway_url, tools=TOOLS)  # tool_choice unset with tools: "auto"
    assert status == 200, reply
    sent = fake.requests[0].sampling
    assert sent.skip_special_tokens is False and not sent.HasField("structured_outputs")
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Checking." and message["reasoning_content"] == "Need the weather."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_streamed_tool_calls_reassemble_with_the_openai_package(fake, api):
    fake.script = HERMES_CALL
    with api.chat.completions.stream(model="fake-model", messages=ASK, tools=TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    fragments = [event.arguments_delta for event in events if event.type == "tool_calls.function.arguments.delta"]
    assert len(fragments) > 1, "arguments stream in fragments"
    raw = list(api.chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS, stream=True))
    thought = "".join(getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
                      for chunk in raw if chunk.choices)
    assert thought == "Need the weather."


def test_the_openai_packages_reply_goes_back_into_the_conversation(fake, api):
    fake.script = HERMES_CALL
    reply = api.chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS)
    message = reply.choices[0].message
    fake.script = ["Sunny."]
    conversation = [*ASK, message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"}]
    answer = api.chat.completions.create(model="fake-model", messages=conversation, tools=TOOLS)
    assert answer.choices[0].message.content == "Sunny." and answer.choices[0].finish_reason == "stop"
    sent = fake.requests[-1].chat.messages[1]
    assert sent.reasoning_content == "Need the weather." and sent.tool_calls[0].id == message.tool_calls[0].id


def test_required_sends_the_calls_schema_and_reads_an_array(fake, gateway_url):
    fake.script = ['[{"name": "get_weather", ', '"parameters": {"city": "Oslo"}}',
                   ', {"name": "get_time", "parameters": {}}]']
    status, reply = chat(gateway_url, tools=TOOLS, tool_choice="required")
    assert status == 200, reply
    schema = json.loads(fake.requests[0].sampling.structured_outputs.json)
    assert schema == {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": ["get_weather"]}, "parameters": WEATHER},
         "required": ["name", "parameters"]},
        {"properties": {"name": {"type": "string", "enum": ["get_time"]},
                        "parameters": {"type": "object", "properties": {}}}, "required": ["name", "parameters"]}]}}
    calls = reply["choices"][0]["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert reply["choices"][0]["finish_reason"] == "tool_calls"


def test_parallel_tool_calls_false_caps_the_required_array_at_one_call(fake, gateway_url):
    fake.script = ['[{"name": "get_time", "parameters": {}}]']
    status, reply = chat(gateway_url, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert status == 200, reply
    schema = json.loads(fake.requests[0].sampling.structured_outputs.json)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert len(reply["choices"][0]["message"]["tool_calls"]) == 1


def test_parallel_tool_calls_false_shows_only_the_first_of_the_models_own_calls(fake, gateway_url, api):
    second = ["<tool_call>", '\n{"name": "get_time", "arguments": {}}\n', "</tool_call>"]
    fake.script = HERMES_CALL + second
    status, reply = chat(gateway_url, tools=TOOLS, parallel_tool_calls=False)
    assert status == 200, reply
    choice = reply["choices"][0]
    assert [call["function"]["name"] for call in choice["message"]["tool_calls"]] == ["get_weather"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    with api.chat.completions.stream(model="fake-model", messages=ASK, tools=TOOLS, parallel_tool_calls=False) as stream:
        final = stream.get_final_completion()
    assert [call.function.name for call in final.choices[0].message.tool_calls] == ["get_weather"]
    assert chat(gateway_url, tools=TOOLS)[1]["choices"][0]["message"]["tool_calls"][1]["function"]["name"] == "get_time"


def test_a_required_output_cut_by_max_tokens_keeps_its_complete_calls_and_is_never_content(fake, gateway_url, api):
    fake.script = ['[{"name": "get_time", "parameters": {}}', ',\n\n', '{"name": "get_weather", ',
                   '"parameters": {"city": "Os']
    fake.script_ends_by_length = True
    status, reply = chat(gateway_url, tools=TOOLS, tool_choice="required", max_tokens=4)
    assert status == 200, reply
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "length" and not choice["message"]["content"]
    assert [call["function"]["name"] for call in choice["message"]["tool_calls"]] == ["get_time"]
    with api.chat.completions.stream(model="fake-model", messages=ASK, tools=TOOLS, tool_choice="required",
                                     max_tokens=4) as stream:
        events = list(stream)
    assert not "".join(event.delta for event in events if event.type == "content.delta")
    last_chunk = [event.chunk for event in events if event.type == "chunk"][-1]
    assert last_chunk.choices[0].finish_reason == "length"


def test_a_named_function_sends_its_parameters_schema_and_reads_its_arguments(fake, api):
    fake.script = ['{"city"', ': "Rome"}']
    choice = {"type": "function", "function": {"name": "get_weather"}}
    with api.chat.completions.stream(model="fake-model", messages=ASK, tools=TOOLS, tool_choice=choice) as stream:
        final = stream.get_final_completion()
    assert json.loads(fake.requests[0].sampling.structured_outputs.json) == WEATHER
    [call] = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}


def test_a_forced_choices_constraint_starts_after_the_thought_which_is_read_as_reasoning(fake, gateway_url):
    # With --reasoning-parser, the constraint applies after </think> (the scheduler's reasoning_end).
    fake.script = ["<think>pick one</think>", '[{"name": "get_time", "parameters": {}}]']
    status, reply = chat(gateway_url, tools=TOOLS, tool_choice="required")
    assert fake.requests[0].sampling.structured_outputs.reasoning_end == "</think>"
    message = reply["choices"][0]["message"]
    assert status == 200 and message["tool_calls"][0]["function"]["name"] == "get_time"
    assert message["reasoning_content"] == "pick one"


def test_a_constraint_without_a_reasoning_parser_starts_at_the_first_token(fake, plain_gateway_url):
    status, _ = chat(plain_gateway_url, tools=TOOLS, tool_choice="required")
    assert status == 200 and fake.requests[0].sampling.structured_outputs.reasoning_end == ""


def test_include_reasoning_false_leaves_the_thought_out(fake, gateway_url):
    fake.script = ["<think>hm</think>", "Sunny."]
    status, reply = chat(gateway_url, include_reasoning=False)
    assert status == 200 and reply["choices"][0]["message"] == {"role": "assistant", "content": "Sunny."}


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_moon"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    # Schema-level failures name the top-level field; the message names the path (tools.0.function.parameters).
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "an object"}}]}, "tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tools_and_tool_choices_are_400s_naming_the_field(fake, gateway_url, body, param):
    status, reply = chat(gateway_url, **body)
    assert status == 400 and reply["error"]["param"] == param, reply
    assert not fake.requests


def test_auto_without_the_servers_flags_is_a_400(fake, plain_gateway_url):
    status, reply = chat(plain_gateway_url, tools=TOOLS)
    assert status == 400 and reply["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in reply["error"]["message"]
    assert chat(plain_gateway_url, tools=TOOLS, tool_choice="required")[0] == 200  # forced choices need no parser


@pytest.mark.parametrize("argv, named", [
    (["--tool-call-parser", "nope"], "hermes, llama3_json, mistral"),
    (["--reasoning-parser", "nope"], "deepseek_r1, qwen3"),
    (["--enable-auto-tool-choice"], "hermes, llama3_json, mistral"),
])
def test_unknown_parser_names_stop_serve_listing_the_known_ones(argv, named, capsys):
    with pytest.raises(SystemExit):
        parse_args(["serve", *argv])
    assert named in capsys.readouterr().err
