"""Reasoning parsers by vLLM's --reasoning-parser names: each splits a reasoning model's output into its
thought (`reasoning_content`) and its answer (`content`)."""

from __future__ import annotations

from gateway.reasoning_parsers.think_tags import ThinkTagReasoningParser

REASONING_PARSERS: dict[str, ThinkTagReasoningParser] = {
    # Qwen3 opens its thought with <think> itself (none when thinking is off: all content then).
    "qwen3": ThinkTagReasoningParser(opening_required=True),
    # DeepSeek-R1's template opens <think> in the prompt: the output is thought until </think>.
    "deepseek_r1": ThinkTagReasoningParser(opening_required=False),
}
