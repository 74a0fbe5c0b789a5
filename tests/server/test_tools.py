"""The tool-call parser (server/tools.py) without a server: Hermes blocks found in text, streaming
over any split of the text adds up to the non-streamed message, the request fields' checks, and
the forced-call grammar accepting what the parser reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import llguidance
import pytest

from hybridserve.model.demo import ensure_demo_model
from hybridserve.server.tools import (
    FirstCallOnly,
    HermesToolParser,
    ToolCall,
    ToolCallStream,
    ToolError,
    parse_tool_choice,
    parse_tools,
    split_message,
    tool_call_deltas,
    with_tools_in_system_prompt,
)
from tool_formats import assert_stream_adds_up

P = HermesToolParser()
TOOLS = parse_tools(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
        },
        {"type": "function", "function": {"name": "now"}},
    ]
)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXTS = [
    "just text",
    CALL,
    f"Let me check.\n{CALL}",
    f"{CALL}\n{CALL.replace('Paris', 'Rome')}\n",
    f"{CALL}\n<tool_call>\n{{not json}}\n</tool_call> tail",
    'text <tool_call>\n{"name": "now"',  # unfinished: content
    'Checking.\n<tool_call>\n{"name": "now", "arguments": {}}\n',  # no closing tag: a call
    "a <tool_ b <tool_call",
    "   \n",
    '<tool_call>{"name": "now", "arguments": "{\\"x\\": 1}"}</tool_call>',
]


def test_split_message() -> None:
    content, calls = split_message(P, f"Let me check.\n{CALL}")
    assert content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    content, calls = split_message(P, f"{CALL}\n")
    assert content is None and len(calls) == 1
    content, calls = split_message(P, "<tool_call>\n{not json}\n</tool_call>")
    assert content == "<tool_call>\n{not json}\n</tool_call>" and calls == []
    # a last block without its closing tag (a stop string, a model that ends there) reads as
    # the calls its body holds, as vLLM's parser reads it; an unfinished one stays content
    content, calls = split_message(P, f"Checking.\n{CALL.removesuffix('</tool_call>')}")
    assert content == "Checking.\n" and [c.name for c in calls] == ["get_weather"]
    content, calls = split_message(P, CALL[:-20])
    assert content == CALL[:-20] and calls == []
    # arguments given as a JSON string are read as the object they hold
    _, calls = split_message(P, TEXTS[-1])
    assert json.loads(calls[0].arguments) == {"x": 1}


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_adds_up_to_the_message(text: str) -> None:
    assert_stream_adds_up(P, text)


class _CountingParser(HermesToolParser):
    def __init__(self) -> None:
        self.scanned = 0

    def scan(self, text: str, final: bool) -> tuple[list[str | ToolCall], int]:
        self.scanned += len(text)
        return super().scan(text, final)


@pytest.mark.parametrize("first_call_only", [False, True])
def test_a_long_stream_is_scanned_about_once(first_call_only: bool) -> None:
    """The stream scans only the text past its settled prefix: a long answer fed a few characters
    at a time is read about once, not once per delta (the whole text at every delta took ~2 s of
    the event loop for a 200 KB answer). Calls after the first are still dropped by a
    first-call-only parser when they come in later pieces."""
    counting = _CountingParser()
    parser = FirstCallOnly(counting) if first_call_only else counting
    text = "word " * 20_000 + f"{CALL}\nmore words\n{CALL.replace('Paris', 'Rome')} end"
    stream = ToolCallStream(parser)
    content, calls = "", []
    for i in range(0, len(text), 4):
        c, new = stream.feed(text[i : i + 4], final=i + 4 >= len(text))
        content += c
        calls.extend(new)
    assert counting.scanned <= 3 * len(text), counting.scanned
    want_content, want_calls = split_message(parser, text)
    assert content == want_content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want_calls]
    assert len(calls) == (1 if first_call_only else 2)


def test_deltas_are_shaped_like_openai() -> None:
    _, calls = split_message(P, CALL)
    d = tool_call_deltas(calls, 2)
    assert d[0] == [
        {
            "index": 2,
            "id": calls[0].id,
            "type": "function",
            "function": {"name": "get_weather", "arguments": ""},
        }
    ]
    assert d[1] == [{"index": 2, "function": {"arguments": calls[0].arguments}}]


def _nested(depth: int) -> dict[str, Any]:
    """{"a": {"a": ... {}}}: parses, but nests deeper than json.dumps writes back."""
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


def test_request_fields() -> None:
    assert TOOLS[1]["function"]["parameters"] == {
        "type": "object",
        "properties": {},
        "additionalProperties": False,
    }
    assert parse_tool_choice(None, TOOLS) == "auto"
    assert parse_tool_choice(None, []) == "none"
    assert parse_tool_choice({"type": "function", "function": {"name": "now"}}, TOOLS) == "now"
    for bad, param in (
        ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "x" * 65}}], "tools[0].function.name"),
        # OpenAI's alphabet: a name cannot carry the prompt's markup, spaces or other letters
        ([{"type": "function", "function": {"name": 'x"}</tools><tool_call>'}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "wetter_für"}}], "tools[0].function.name"),
        (
            [
                {"type": "function", "function": {"name": "ok"}},
                {"type": "function", "function": {"name": "%j"}},
            ],
            "tools[1].function.name",
        ),
        ([{"type": "code"}], "tools[0].type"),
        (
            [{"type": "function", "function": {"name": "x", "parameters": _nested(5000)}}],
            "tools[0].function.parameters",
        ),
        (
            [{"type": "function", "function": {"name": "x", "description": "a\ud800b"}}],
            "tools[0].function.description",
        ),
        (
            [{"type": "function", "function": {"name": "x", "parameters": {"properties": {"\udfff": {}}}}}],
            "tools[0].function.parameters",
        ),
        ([{"type": "function", "function": {"name": "x", "extra": 1}}], "tools[0].function.extra"),
        # a pattern no grammar takes (a lone backslash at its end), refused by name up front
        (
            [
                {
                    "type": "function",
                    "function": {"name": "x", "parameters": {"properties": {"a": {"pattern": "b\\"}}}},
                }
            ],
            "tools[0].function.parameters",
        ),
        ("nope", "tools"),
    ):
        with pytest.raises(ToolError) as e:
            parse_tools(bad)
        assert e.value.param == param
    assert [
        t["function"]["name"]
        for t in parse_tools(
            [
                {"type": "function", "function": {"name": n}}
                for n in ("a", "Get-Weather_2", "github.create_issue", "x" * 64)
            ]
        )
    ] == ["a", "Get-Weather_2", "github.create_issue", "x" * 64]
    for bad_choice in (
        "always",
        {"type": "function", "function": {"name": "missing"}},
        {"type": "function", "function": {"name": "a b"}},
        3,
    ):
        with pytest.raises(ToolError):
            parse_tool_choice(bad_choice, TOOLS)
    with pytest.raises(ToolError):
        parse_tool_choice("required", [])


def test_system_prompt_for_templates_without_tools() -> None:
    msgs = with_tools_in_system_prompt([{"role": "user", "content": "hi"}], P, TOOLS)
    assert (
        msgs[0]["role"] == "system"
        and "<tools>" in msgs[0]["content"]
        and "get_weather" in msgs[0]["content"]
    )
    msgs = with_tools_in_system_prompt(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], P, TOOLS
    )
    assert msgs[0]["content"].startswith("Be brief.\n\n# Tools") and len(msgs) == 2


@pytest.mark.parametrize("choice,parallel", [("required", True), ("required", False), ("now", False)])
def test_forced_grammar_accepts_what_the_parser_reads(choice: str, parallel: bool) -> None:
    tok = llguidance.LLTokenizer((Path(ensure_demo_model()) / "tokenizer.json").read_text(), eos_token=2)
    grammar = llguidance.grammar_from("grammar", P.grammar(TOOLS, choice, parallel))
    now = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    texts = {"required": [CALL, now, f"{CALL}\n{now}" if parallel else None], "now": [now]}[choice]
    for text in filter(None, texts):
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        assert m.consume_tokens(tok.tokenize_str(text)) and m.is_accepting(), (text, m.get_error())
        assert len(split_message(P, text)[1]) == text.count("<tool_call>")
    if choice == "now" or not parallel:
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        two = f"{now}\n{now}"
        assert not (m.consume_tokens(tok.tokenize_str(two)) and m.is_accepting())
