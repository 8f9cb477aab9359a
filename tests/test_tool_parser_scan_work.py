"""Streamed parsing is incremental (gateway/tool_parsers/scan_memo.py): every format read with one growing
memo gives at each prefix exactly the snapshot a fresh parse gives, and a long output (a long thought, then a
call whose string argument runs to 30,000 characters) streamed in 4-character chunks costs each chunk about its
own length in characters scanned, however long the output already is: the work per chunk stays flat, not
quadratic in the output."""

from __future__ import annotations

import json

import pytest

from gateway.chat_output import ChatOutput
from gateway.reasoning_parsers import REASONING_PARSERS
from gateway.tool_parsers import TOOL_CALL_PARSERS
from gateway.tool_parsers.forced_calls import NamedFunctionOutput, RequiredToolsOutput
from gateway.tool_parsers.scan_memo import ScanMemo
from tests.test_tool_parsers import HERMES, LLAMA, MISTRAL, MISTRAL_V11, TIME, WEATHER

CODE = "def f(x):\n    return \"x\\\\\" + x  # {[\n" * 750  # about 30,000 characters, quotes and brackets inside
THOUGHT = "Let me think about </thin this. " * 600
CHUNK = 4


def call_texts() -> list[tuple[object, str]]:
    weather = json.dumps({"name": "get_weather", "arguments": {"city": "Paris", "code": CODE}})
    llama = json.dumps({"name": "get_weather", "parameters": {"code": CODE}})
    return [
        (TOOL_CALL_PARSERS["hermes"](), f"Checking.<tool_call>\n{weather}\n</tool_call>"),
        (TOOL_CALL_PARSERS["llama3_json"](), f"<|python_tag|>{llama}; {llama}"),
        (TOOL_CALL_PARSERS["mistral"](), f"[TOOL_CALLS][{weather}]"),
        (TOOL_CALL_PARSERS["mistral"](), f"[TOOL_CALLS]get_weather[ARGS]{json.dumps({'code': CODE})}"),
        (NamedFunctionOutput("get_weather"), json.dumps({"code": CODE})),
        (RequiredToolsOutput(), json.dumps([{"name": "get_weather", "parameters": {"code": CODE}}])),
    ]


@pytest.mark.parametrize("parser, text", [
    (TOOL_CALL_PARSERS["hermes"](), HERMES), (TOOL_CALL_PARSERS["llama3_json"](), LLAMA),
    (TOOL_CALL_PARSERS["mistral"](), MISTRAL), (TOOL_CALL_PARSERS["mistral"](), MISTRAL_V11),
    (NamedFunctionOutput("get_weather"), json.dumps(WEATHER)),
    (RequiredToolsOutput(), json.dumps([{"name": "a", "parameters": WEATHER}, {"name": "b", "parameters": TIME}])),
    (TOOL_CALL_PARSERS["hermes"](), '<tool_call>{"name": "f", "arguments": {"a": "x</tool_call>"}}'),
])
def test_a_memo_gives_the_snapshots_of_fresh_parses_at_every_prefix(parser, text):
    memo = ScanMemo()
    for end in range(len(text) + 1):
        for final in (False, True) if end == len(text) else (False,):
            try:
                fresh = parser.parse(text[:end], final)
            except ValueError as error:
                fresh = type(error)
            try:
                remembered = parser.parse(text[:end], final, memo)
            except ValueError as error:
                remembered = type(error)
            assert remembered == fresh, text[:end]


def test_a_reasoning_split_with_a_memo_equals_a_fresh_one_at_every_prefix():
    text = "<think>\nPlan: check </thin the sky.\n</think>\n\nIt is sunny."
    for name, parser in REASONING_PARSERS.items():
        memo = ScanMemo()
        for end in range(len(text) + 1):
            assert parser.split(text[:end], False, memo) == parser.split(text[:end], False), (name, end)


@pytest.mark.parametrize("index", range(len(call_texts())))
def test_the_characters_scanned_per_chunk_do_not_grow_with_the_output(index):
    parser, answer = call_texts()[index]
    text = f"<think>{THOUGHT}</think>{answer}"
    output = ChatOutput(REASONING_PARSERS["qwen3"], parser)
    per_chunk = []
    for start in range(0, len(text), CHUNK):
        before = output.chars_scanned
        output.add(text[start:start + CHUNK])
        per_chunk.append(output.chars_scanned - before)
    output.finish()
    assert output.calls_tools and len(text) > 50_000
    # Each chunk's own characters, a marker's length searched again, a call's short members re-read: a few
    # dozen characters, whether the output so far holds 100 characters or 50,000. A parse of the whole text
    # after every chunk would scan tens of thousands by the end.
    assert max(per_chunk) < 200
    assert max(per_chunk[-100:]) <= max(per_chunk[:len(per_chunk) // 2]) + 50
    assert output.chars_scanned < 10 * len(text)  # a whole parse per chunk: about len(text) ** 2 / 8
