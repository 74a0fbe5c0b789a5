"""Helpers for the tool-call format tests: a parser's stream over random cuts of a text, a
streamed chat answer's content and calls as the openai client sees them, and two chat tools whose
forced calls the demo model ends within a few tokens (bounded arguments)."""

from __future__ import annotations

import random
from typing import Any

import openai

from hybridserve.server.tools import ToolCallStream, ToolParser, split_message

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


def assert_stream_adds_up(parser: ToolParser, text: str) -> None:
    """Fed in random pieces (30 ways), the stream's content and calls are split_message's."""
    rng = random.Random(len(text))
    expected_content, expected_calls = split_message(parser, text)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 8))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream = ToolCallStream(parser)
        content, calls = "", []
        for i, piece in enumerate(pieces):
            c, new = stream.feed(piece, final=i == len(pieces) - 1)
            content += c
            calls.extend(new)
        assert (content or None) == expected_content
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in expected_calls]


def stream_chat(client: openai.OpenAI, **kw: Any) -> tuple[str | None, list[dict[str, str]], str | None]:
    """(content, calls as {"name", "arguments"}, finish reason) of a streamed chat answer."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                slot["name"] += (tc.function and tc.function.name) or ""
                slot["arguments"] += (tc.function and tc.function.arguments) or ""
            finish = ch.finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish
