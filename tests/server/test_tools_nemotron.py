"""The `nemotron_json` tool-call format (`<TOOLCALL>[{"name": ..., "arguments": ...}, ...]</TOOLCALL>`,
server/tools.py): blocks read as calls, a stream cut anywhere adds up to the whole message, the
forced-call grammar accepts what the parser reads, an agent's history written back in the same
format reads back as the same calls, and a real server started with `--tool-call-parser
nemotron_json` answers forced calls in it, streamed and not, through the official openai client."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import llguidance
import openai
import pytest

from hybridserve.model.demo import ensure_demo_model
from hybridserve.server.tools import (
    TOOL_PARSERS,
    NemotronJsonToolParser,
    ToolCallStream,
    parse_tools,
    split_message,
    with_tool_history_as_text,
    with_tools_in_system_prompt,
)
from server_fixtures import call, running_server

P = NemotronJsonToolParser()
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = parse_tools([WEATHER, NOW])
ONE = '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>'
TWO = '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "now", "arguments": {}}]</TOOLCALL>'
TEXTS = [
    "just text",
    ONE,
    TWO,
    f"Let me check.\n{ONE}",
    f"{ONE} and {TWO}",
    '<TOOLCALL>{"name": "now", "arguments": {}}</TOOLCALL>',  # one call without its list
    '<TOOLCALL>[{"name": "now", "arguments": "{\\"x\\": 1}"}]</TOOLCALL>',  # arguments as JSON text
    "<TOOLCALL>[]</TOOLCALL> empty",
    '<TOOLCALL>[{"name": "now"}, {"nom": 1}]</TOOLCALL>',  # one bad item: the block is text
    "<TOOLCALL>[not json]</TOOLCALL> tail",
    'text <TOOLCALL>[{"name": "now"',  # unfinished: content
    "a <TOOL b <TOOLCAL",
    "  \n",
]


def _calls(text: str) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in split_message(P, text)[1]]


def test_blocks_read_as_calls() -> None:
    assert TOOL_PARSERS["nemotron_json"].name == "nemotron_json"
    assert split_message(P, f"Let me check.\n{ONE}")[0] == "Let me check.\n"
    assert _calls(ONE) == [("get_weather", {"city": "Paris"})]
    assert _calls(TWO) == [("get_weather", {"city": "Rome"}), ("now", {})]
    assert split_message(P, TWO)[0] is None
    assert _calls(TEXTS[5]) == [("now", {})]
    assert _calls(TEXTS[6]) == [("now", {"x": 1})]
    for text in TEXTS[7:11]:  # not calls: the text is content, whole
        content, calls = split_message(P, text)
        assert calls == [] and content == text


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_adds_up_to_the_message(text: str) -> None:
    rng = random.Random(len(text))
    expected_content, expected_calls = split_message(P, text)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 8))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream = ToolCallStream(P)
        content, calls = "", []
        for i, piece in enumerate(pieces):
            c, new = stream.feed(piece, final=i == len(pieces) - 1)
            content += c
            calls.extend(new)
        assert (content or None) == expected_content
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in expected_calls]


@pytest.mark.parametrize("choice,parallel", [("required", True), ("required", False), ("now", False)])
def test_forced_grammar_accepts_what_the_parser_reads(choice: str, parallel: bool) -> None:
    tok = llguidance.LLTokenizer((Path(ensure_demo_model()) / "tokenizer.json").read_text(), eos_token=2)
    grammar = llguidance.grammar_from("grammar", P.grammar(TOOLS, choice, parallel))
    now = '<TOOLCALL>[{"name": "now", "arguments": {}}]</TOOLCALL>'
    both = '<TOOLCALL>[{"name": "now", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]</TOOLCALL>'
    accepted = {"required": [ONE, now, both if parallel else None], "now": [now]}[choice]
    for text in filter(None, accepted):
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        assert m.consume_tokens(tok.tokenize_str(text)) and m.is_accepting(), (text, m.get_error())
        assert len(_calls(text)) == text.count('"name"')
    refused = [both] if choice == "now" or not parallel else []
    refused.append('<TOOLCALL>[{"name": "get_weather", "arguments": {"town": "Oslo"}}]</TOOLCALL>')
    refused.append("<TOOLCALL>[]</TOOLCALL>")
    for text in refused:
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        assert not (m.consume_tokens(tok.tokenize_str(text)) and m.is_accepting()), text


def test_history_is_written_in_the_format_it_is_read_in() -> None:
    calls = [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
        },
        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
    ]
    history = [
        {"role": "user", "content": "Weather and time?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
    ]
    out = with_tool_history_as_text(history, P, calls=True, results=True)
    assert _calls(out[1]["content"]) == [("get_weather", {"city": "Oslo"}), ("now", {})]
    assert out[2] == {
        "role": "user",
        "content": "<TOOL_RESPONSE>sunny</TOOL_RESPONSE>\n<TOOL_RESPONSE>noon</TOOL_RESPONSE>",
    }
    assert len(out) == 3
    system = with_tools_in_system_prompt([{"role": "user", "content": "hi"}], P, TOOLS)[0]["content"]
    assert "<AVAILABLE_TOOLS>" in system and "get_weather" in system and "<TOOLCALL>[" in system


def _stream(client: openai.OpenAI, **kw: Any) -> tuple[str | None, list[dict[str, str]], str | None]:
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


def test_a_server_with_the_nemotron_format_forces_and_reads_its_calls() -> None:
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    with running_server("--dtype", "float32", "--tool-call-parser", "nemotron_json") as server:
        # the demo model's template does not render tools: they are described in this format
        status, tok = call(
            server, "/tokenize", {"messages": messages, "tools": [WEATHER], "return_token_strs": True}
        )
        assert status == 200 and "AVAILABLE_TOOLS" in "".join(tok["token_strs"])
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="none", max_retries=0)
        checked = 0
        for seed, kw in enumerate(
            (
                {"tool_choice": "required", "parallel_tool_calls": False},
                {"tool_choice": {"type": "function", "function": {"name": "now"}}},
                {"tool_choice": "required"},
            )
        ):
            body = {
                "model": "demo",
                "messages": messages,
                "tools": [WEATHER, NOW],
                "max_tokens": 120,
                "seed": seed,
                **kw,
            }
            full = client.chat.completions.create(**body).choices[0]
            if full.finish_reason == "length":  # (parallel calls may run out of tokens)
                continue
            assert full.finish_reason == "tool_calls" and full.message.content is None
            got = [(c.function.name, json.loads(c.function.arguments)) for c in full.message.tool_calls]
            assert got and all(name in ("get_weather", "now") for name, _ in got)
            if "parallel_tool_calls" in kw or isinstance(kw["tool_choice"], dict):
                assert len(got) == 1
            if isinstance(kw["tool_choice"], dict):
                assert got == [("now", {})]
            content, calls, finish = _stream(client, **body)
            assert (content, finish) == (None, "tool_calls")
            assert [(c["name"], c["arguments"]) for c in calls] == [
                (c.function.name, c.function.arguments) for c in full.message.tool_calls
            ]
            checked += 1
        assert checked >= 2  # (the two single-call cases always end in time)
