"""Tools and tool-call conversations rendered at the gRPC edge exactly as transformers' apply_chat_template
renders them with Qwen2.5's tool-calling template: the tools listed, an assistant's calls (arguments sent as
JSON text, rendered as objects as vLLM does), a tool's result, and a message without content."""

from __future__ import annotations

import json

import pytest

from pagedserve.testing.tiny_tokenizers import write_opt_tokenizer
from pagedserve.testing.tool_chat_template import QWEN2_5_TOOL_TEMPLATE
from protos.pagedserve.v1 import generate_pb2
from scheduler_svc.api.prompt_encoding import render_chat
from scheduler_svc.core.validated_request import InvalidRequestError
from scheduler_svc.text.tokenizer_loading import load_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ARGUMENTS = {"city": "Paris", "when": ["now", "é"]}


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    directory = write_opt_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    (directory / "chat_template.jinja").write_text(QWEN2_5_TOOL_TEMPLATE)
    return directory


def wire_chat(tools_json: str = json.dumps(TOOLS)) -> generate_pb2.ChatPrompt:
    return generate_pb2.ChatPrompt(messages=[
        generate_pb2.ChatMessage(role="user", content="Weather in Paris?"),
        generate_pb2.ChatMessage(role="assistant", tool_calls=[
            generate_pb2.ToolCall(id="call_1", name="get_weather", arguments=json.dumps(ARGUMENTS))]),
        generate_pb2.ChatMessage(role="tool", content="sunny", tool_call_id="call_1"),
    ], tools_json=tools_json)


def test_tools_and_calls_render_as_transformers_renders_them(directory):
    from transformers import AutoTokenizer

    rendered = render_chat(wire_chat(), load_tokenizer(str(directory)))
    reference = AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(
        [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                               "function": {"name": "get_weather", "arguments": ARGUMENTS}}]},
         {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}],
        tools=TOOLS, chat_template=QWEN2_5_TOOL_TEMPLATE, add_generation_prompt=True, tokenize=False)
    assert rendered == reference
    assert '"name": "get_weather"' in rendered and "<tool_response>\nsunny" in rendered
    assert '"arguments": {"city": "Paris", "when": ["now", "é"]}' in rendered  # an object, not quoted text


def test_without_tools_the_template_takes_its_plain_branch(directory):
    rendered = render_chat(wire_chat(tools_json=""), load_tokenizer(str(directory)))
    assert "<tools>" not in rendered and rendered.startswith("<|im_start|>system\nYou are Qwen")


def test_tools_must_be_a_json_array_of_objects(directory):
    with pytest.raises(InvalidRequestError) as refused:
        render_chat(wire_chat(tools_json='{"type": "function"}'), load_tokenizer(str(directory)))
    assert refused.value.field == "prompt.chat.tools"
