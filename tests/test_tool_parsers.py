"""Tool-call and reasoning parsers on model text: the whole output gives the message OpenAI's API returns,
and the same text streamed in pieces split at every character boundary (and one character at a time) gives
deltas that reassemble to that message, whichever format (hermes, llama3_json, mistral, a forced tool
choice) and whichever reasoning parser."""

from __future__ import annotations

import json

import pytest

from gateway.chat_output import ChatOutput
from gateway.reasoning_parsers import REASONING_PARSERS
from gateway.tool_parsers import TOOL_CALL_PARSERS
from gateway.tool_parsers.forced_calls import NamedFunctionOutput, RequiredToolsOutput

WEATHER = {"city": "Paris \"FR\"", "days": [1, 2], "units": {"t": "°C"}}
TIME = {"zone": "CET}"}


def whole(parser, text: str, reasoning=None) -> tuple[dict, bool]:
    output = ChatOutput(reasoning, parser)
    output.add(text)
    output.finish()
    return output.message(), output.calls_tools


def streamed(parser, pieces: list[str], reasoning=None) -> dict:
    """The message the deltas of `pieces` reassemble to (as the openai package's stream helpers do)."""
    output = ChatOutput(reasoning, parser)
    deltas = [output.add(piece) for piece in pieces] + [output.finish()]
    content, thought, calls = "", "", {}
    for delta in deltas:
        content += delta.get("content", "")
        thought += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["index"] == len(calls), "calls open in order, once"
                calls[call["index"]] = {"id": call["id"], "name": call["function"]["name"], "arguments": ""}
            calls[call["index"]]["arguments"] += call["function"].get("arguments", "")
    return {"content": content, "reasoning_content": thought, "tool_calls": list(calls.values())}


def splits(text: str):
    yield [text[i] for i in range(len(text))]
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]


def assert_streams_like_whole(parser, text: str, reasoning=None) -> dict:
    message, calls_tools = whole(parser, text, reasoning)
    for pieces in splits(text):
        assembled = streamed(parser, pieces, reasoning)
        assert assembled["content"] == (message["content"] or ""), pieces
        assert assembled["reasoning_content"] == (message.get("reasoning_content") or ""), pieces
        if calls_tools:
            assert [(c["name"], c["arguments"]) for c in assembled["tool_calls"]] == [
                (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]], pieces
    return message


def calls_of(message: dict) -> list[tuple[str, object]]:
    return [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in message["tool_calls"]]


HERMES = ("Let me check.<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": WEATHER})
          + "\n</tool_call>\n<tool_call>\n" + json.dumps({"name": "get_time", "arguments": TIME}) + "\n</tool_call>")
LLAMA = "<|python_tag|>" + json.dumps({"name": "get_weather", "parameters": WEATHER}) + "; " + json.dumps(
    {"name": "get_time", "parameters": TIME})
MISTRAL = "Sure[TOOL_CALLS]" + json.dumps([{"name": "get_weather", "arguments": WEATHER},
                                           {"name": "get_time", "arguments": TIME}])
MISTRAL_V11 = f"[TOOL_CALLS]get_weather[ARGS]{json.dumps(WEATHER)}[TOOL_CALLS]get_time[ARGS]{json.dumps(TIME)}"


@pytest.mark.parametrize("name, text, content", [
    ("hermes", HERMES, "Let me check."),
    ("llama3_json", LLAMA, None),
    ("llama3_json", LLAMA.removeprefix("<|python_tag|>"), None),
    ("mistral", MISTRAL, "Sure"),
    ("mistral", MISTRAL_V11, None),
])
def test_each_format_gives_its_calls_whole_and_streamed(name, text, content):
    message = assert_streams_like_whole(TOOL_CALL_PARSERS[name](), text)
    assert calls_of(message) == [("get_weather", WEATHER), ("get_time", TIME)]
    assert message["content"] == content


@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
@pytest.mark.parametrize("text", ["The weather is fine.", "Use <b>bold</b> {braces} [brackets]", ""])
def test_plain_answers_stay_content(name, text):
    message, calls_tools = whole(TOOL_CALL_PARSERS[name](), text)
    assert not calls_tools and message["content"] == text and "tool_calls" not in message
    assert_streams_like_whole(TOOL_CALL_PARSERS[name](), text)


@pytest.mark.parametrize("name, text", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),  # cut by max_tokens
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": "not an object"}</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}} and then text'),
    ("mistral", '[TOOL_CALLS][{"arguments": {"city": "Paris"}}]'),  # no name
])
def test_malformed_or_unfinished_calls_fall_back_to_content(name, text):
    message, calls_tools = whole(TOOL_CALL_PARSERS[name](), text)
    assert not calls_tools and message["content"] == text


def test_forced_named_function_reads_the_whole_output_as_arguments():
    message = assert_streams_like_whole(NamedFunctionOutput("get_weather"), " " + json.dumps(WEATHER))
    assert calls_of(message) == [("get_weather", WEATHER)] and message["content"] is None


def test_forced_required_reads_an_array_of_name_and_parameters():
    text = json.dumps([{"name": "get_weather", "parameters": WEATHER}, {"name": "get_time", "parameters": TIME}])
    message = assert_streams_like_whole(RequiredToolsOutput(), text)
    assert calls_of(message) == [("get_weather", WEATHER), ("get_time", TIME)]


@pytest.mark.parametrize("name, text, thought, content", [
    ("qwen3", "<think>\nPlan: check </thin the sky.\n</think>\n\nIt is sunny.", "\nPlan: check </thin the sky.\n",
     "\n\nIt is sunny."),
    ("qwen3", "It is sunny.", None, "It is sunny."),  # thinking off: no thought
    ("deepseek_r1", "Plan: look up.</think>It is sunny.", "Plan: look up.", "It is sunny."),
    ("deepseek_r1", "<think>Plan</think>It is sunny.", "Plan", "It is sunny."),
    ("deepseek_r1", "Still thinking when max_tokens hit", "Still thinking when max_tokens hit", None),
])
def test_reasoning_parsers_split_thought_from_answer(name, text, thought, content):
    message = assert_streams_like_whole(None, text, REASONING_PARSERS[name])
    assert message["reasoning_content"] == thought and message["content"] == content


def test_tool_calls_after_a_thought():
    text = "<think>I need the weather.</think>\n" + HERMES
    message = assert_streams_like_whole(TOOL_CALL_PARSERS["hermes"](), text, REASONING_PARSERS["qwen3"])
    assert message["reasoning_content"] == "I need the weather."
    assert message["content"] == "\nLet me check." and len(message["tool_calls"]) == 2


def test_mistral_call_ids_are_nine_alphanumerics():
    message, _ = whole(TOOL_CALL_PARSERS["mistral"](), MISTRAL)
    assert all(len(call["id"]) == 9 and call["id"].isalnum() for call in message["tool_calls"])
