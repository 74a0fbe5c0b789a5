"""The tool-call formats besides Hermes (server/tools.py): `nemotron_json`
(`<TOOLCALL>[{"name": ..., "arguments": ...}, ...]</TOOLCALL>`) and `qwen3_coder`
(`<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>`, values typed by
the tool's schema). For each: blocks read as calls, a stream cut anywhere adds up to the whole
message, the forced-call grammar accepts what the parser reads and refuses what breaks the
schema, an agent's history written back in the format reads back as the same calls, and a real
server started with `--tool-call-parser` of it answers forced calls in it, streamed and not,
through the official openai client."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import llguidance
import openai
import pydantic
import pytest

from hybridserve.engine.tokenizer import Tokenizer
from hybridserve.model.demo import ensure_demo_model
from hybridserve.server import protocol
from hybridserve.server.tools import (
    TOOL_PARSERS,
    FirstCallOnly,
    NemotronJsonToolParser,
    Qwen3CoderToolParser,
    ToolError,
    _typed_value,
    parse_tools,
    split_message,
    with_tool_history_as_text,
    with_tools_in_system_prompt,
)
from server_fixtures import TokenizerModelInfo, call, running_server
from tool_formats import assert_stream_adds_up, demo_with_added_tags, stream_chat


@functools.cache
def _tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer((Path(ensure_demo_model()) / "tokenizer.json").read_text(), eos_token=2)


def _accepts(grammar: str, text: str) -> tuple[bool, str]:
    """Whether the grammar (llguidance's Lark) takes exactly `text`, and the matcher's error."""
    tok = _tokenizer()
    m = llguidance.LLMatcher(tok, llguidance.grammar_from("grammar", grammar), log_level=0)
    return bool(m.consume_tokens(tok.tokenize_str(text)) and m.is_accepting()), m.get_error() or ""


P = NemotronJsonToolParser()
Q = Qwen3CoderToolParser()
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


def test_nemotron_blocks_read_as_calls() -> None:
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
def test_nemotron_streaming_adds_up_to_the_message(text: str) -> None:
    assert_stream_adds_up(P, text)


@pytest.mark.parametrize("choice,parallel", [("required", True), ("required", False), ("now", False)])
def test_nemotron_forced_grammar_accepts_what_the_parser_reads(choice: str, parallel: bool) -> None:
    grammar = P.grammar(TOOLS, choice, parallel)
    now = '<TOOLCALL>[{"name": "now", "arguments": {}}]</TOOLCALL>'
    both = '<TOOLCALL>[{"name": "now", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]</TOOLCALL>'
    accepted = {"required": [ONE, now, both if parallel else None], "now": [now]}[choice]
    for text in filter(None, accepted):
        assert _accepts(grammar, text) == (True, ""), text
        assert len(_calls(text)) == text.count('"name"')
    refused = [both] if choice == "now" or not parallel else []
    refused.append('<TOOLCALL>[{"name": "get_weather", "arguments": {"town": "Oslo"}}]</TOOLCALL>')
    refused.append("<TOOLCALL>[]</TOOLCALL>")
    for text in refused:
        assert not _accepts(grammar, text)[0], text


# ---- qwen3_coder ------------------------------------------------------------------------------

TYPED = {
    "type": "function",
    "function": {
        "name": "book",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "nights": {"type": "integer"},
                "budget": {"type": "number"},
                "breakfast": {"type": "boolean"},
                "room": {"enum": ["single", "double"]},
                "guests": {"type": "array", "items": {"type": "string"}},
                "note": {"type": ["string", "null"]},
            },
            "required": ["city", "nights"],
            "additionalProperties": False,
        },
    },
}
QTOOLS = parse_tools([TYPED, NOW])
QB = Q.for_tools(QTOOLS)


def _qcall(function: str, /, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={function}>\n{body}</function>\n</tool_call>"


QONE = _qcall("book", city="Oslo", nights="3")
QTEXTS = [
    "just text",
    QONE,
    f"Let me book.\n{QONE}\n{_qcall('now')}",
    _qcall("book", city="a <b> c\nsecond line", nights="2", budget="99.5", breakfast="true"),
    _qcall("book", city="x", nights="two"),  # not an integer: kept as text
    "<tool_call>\n<function=book>\n<parameter=city>\nOslo\n</parameter>\n</tool_call>",  # no </function>
    "<tool_call>\nnot a call\n</tool_call> tail",
    "text <tool_call>\n<function=book>\n<parameter=city>\nOs",  # unfinished: content
    "a <tool_ b <tool_call",
]


def _qcalls(parser: Any, text: str) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in split_message(parser, text)[1]]


def test_qwen3_coder_values_are_typed_by_the_tools_schema() -> None:
    assert TOOL_PARSERS["qwen3_coder"].name == "qwen3_coder"
    text = _qcall(
        "book",
        city="Oslo",
        nights="3",
        budget="120",
        breakfast="False",
        room="double",
        guests='["Ann", "Bo"]',
        note="null",
        extra="7",
    )
    ((name, args),) = _qcalls(QB, text)
    assert name == "book"
    assert args == {
        "city": "Oslo",
        "nights": 3,
        "budget": 120,
        "breakfast": False,
        "room": "double",
        "guests": ["Ann", "Bo"],
        "note": None,
        "extra": "7",  # not declared: text
    }
    # text stays text: a string that looks like a number, a value that does not parse as its type
    assert _qcalls(QB, _qcall("book", city="42", nights="two")) == [("book", {"city": "42", "nights": "two"})]
    # a multi-line value keeps its inner newlines; the ones around it are the format's
    assert _qcalls(QB, QTEXTS[3])[0][1]["city"] == "a <b> c\nsecond line"
    # without the request's tools (the server binds them), every value is text
    assert _qcalls(Q, QONE) == [("book", {"city": "Oslo", "nights": "3"})]
    for text in QTEXTS[5:7]:
        content, calls = split_message(QB, text)
        assert calls == [] and content == text


def test_qwen3_coder_values_that_do_not_read_stay_text() -> None:
    """What no JSON value holds, or what does not read as its type, stays the text written; the
    typing never raises (a 500), and agrees with the forced grammar's forms."""
    ints = {"type": "integer"}
    nums = {"type": "number"}
    cases = [
        ("1" * 5000, ints, "1" * 5000),  # more digits than Python converts
        ("1e400", nums, "1e400"),  # no finite float
        ("nan", nums, "nan"),
        ("1_000", nums, "1_000"),
        ("2.5", ints, "2.5"),
        ("-0.5e1", nums, -5.0),
        ("12345678901234567890123", nums, 12345678901234567890123),  # exact, not through a float
        ("True", {"type": "boolean"}, True),  # (in any case, as vLLM reads it)
        ("yes", {"type": "boolean"}, "yes"),
        ("[" * 100000, {"type": "array"}, "[" * 100000),  # nested too deep to read
        ("null", {"enum": ["null", "a"]}, "null"),  # a choice of strings is text
        ("null", {"type": ["string", "null"]}, None),
        ("null", {"type": "string"}, "null"),
        ('"hello"', True, '"hello"'),  # a schema of `true`, no type: text, as vLLM reads it
        ("3", None, "3"),  # not declared
    ]
    for raw, schema, want in cases:
        assert _typed_value(raw, schema) == want, (raw[:20], schema)


def test_qwen3_coder_grammar_refuses_what_it_cannot_write() -> None:
    text = QB.grammar(QTOOLS, "book", False)
    for value, ok in (
        ("a<b", True),
        ("a<", True),
        ("a<\nb", True),
        ("<b> c", True),
        ("a</b", False),
        ("x\n</y", False),
    ):
        assert _accepts(text, _qcall("book", city=value, nights="1"))[0] is ok, value
    odd = parse_tools(
        [
            {
                "type": "function",
                "function": {"name": "f", "parameters": {"type": "object", "properties": {"a>b": {}}}},
            }
        ]
    )
    with pytest.raises(ToolError, match="cannot be written"):
        Q.grammar(odd, "required", False)
    # `required` not a list of names: the names it holds, none here
    loose = parse_tools(
        [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {"type": "object", "properties": {"a": {}}, "required": 5},
                },
            }
        ]
    )
    assert "p0_0?" in Q.grammar(loose, "required", False)


@pytest.mark.parametrize("text", QTEXTS)
def test_qwen3_coder_streaming_adds_up_to_the_message(text: str) -> None:
    assert_stream_adds_up(QB, text)


@pytest.mark.parametrize("choice,parallel", [("required", True), ("required", False), ("book", False)])
def test_qwen3_coder_forced_grammar_accepts_what_the_parser_reads(choice: str, parallel: bool) -> None:
    grammar = QB.grammar(QTOOLS, choice, parallel)
    full = _qcall(
        "book", city="Oslo <old> town", nights="3", budget="-2.5e3", breakfast="true", room="single",
        guests='["Ann"]', note="quiet\nplease",
    )  # fmt: skip
    now = _qcall("now")
    accepted = {"required": [QONE, full, now, f"{QONE}\n{now}" if parallel else None], "book": [QONE, full]}
    for text in filter(None, accepted[choice]):
        assert _accepts(grammar, text) == (True, ""), text
        assert len(_qcalls(QB, text)) == text.count("<function=")
    refused = [
        _qcall("book", city="Oslo"),  # a required parameter left out
        _qcall("book", city="Oslo", nights="3.5"),  # not an integer
        _qcall("book", city="Oslo", nights="3", room="suite"),  # not one of the choices
        _qcall("book", city="Oslo", nights="3", pets="1"),  # not declared
        _qcall("book", nights="3", city="Oslo"),  # (the schema's order)
    ]
    if choice == "book" or not parallel:
        refused.append(f"{QONE}\n{QONE}")
    if choice == "book":
        refused.append(now)
    for text in refused:
        assert not _accepts(grammar, text)[0], text


def test_qwen3_coder_forced_numbers_keep_their_schema_s_bounds_and_choices() -> None:
    """A number's minimum, maximum and choices hold in a forced call, as in the JSON formats."""
    props = {
        "hour": {"type": "integer", "minimum": 0, "maximum": 23},
        "share": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "size": {"type": "integer", "enum": [1, 3]},
    }
    fn = {"name": "f", "parameters": {"type": "object", "properties": props, "required": list(props)}}
    tools = parse_tools([{"type": "function", "function": fn}])
    grammar = Q.grammar(tools, "f", False)
    ok = {"hour": "23", "share": "0.5", "size": "3"}
    assert _accepts(grammar, _qcall("f", **ok)) == (True, "")
    assert _qcalls(Q.for_tools(tools), _qcall("f", **ok)) == [("f", {"hour": 23, "share": 0.5, "size": 3})]
    for key, bad in (("hour", "24"), ("hour", "-1"), ("share", "0"), ("share", "1.5"), ("size", "2")):
        assert not _accepts(grammar, _qcall("f", **{**ok, key: bad}))[0], (key, bad)


def test_qwen3_coder_text_values_keep_their_lengths() -> None:
    """A text value's minLength and maxLength hold in a forced call (counted as the parser reads
    the value: without the newlines around it); a longer bound than the grammar keeps is left out."""
    sized = {"type": "string", "minLength": 2, "maxLength": 10}
    tools = parse_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": sized, "b": {"type": "string", "maxLength": 10**6}},
        "required": ["a"]}}}])  # fmt: skip
    parser = Q.for_tools(tools)
    grammar = parser.grammar(tools, "required", False)
    for value, fits in (
        ("ab", True),
        ("abcdefghij", True),
        ("a <b>\nc", True),  # lines, within the bound
        ("a", False),
        ("abcdefghijk", False),
        ("\nabcdefghij", False),  # (a leading newline the parser would drop)
        ("", False),
    ):
        text = _qcall("f", a=value)
        assert _accepts(grammar, text)[0] == fits, value
        if fits:
            assert _qcalls(parser, text) == [("f", {"a": value})]
    # a bound past MAX_TEXT_LENGTH_BOUND is not written into the grammar: any length goes
    assert _accepts(grammar, _qcall("f", a="ab", b="x" * 50))[0]


@pytest.mark.parametrize(
    "parser,result_block,described",
    [
        (P, "<TOOL_RESPONSE>sunny</TOOL_RESPONSE>", ("<AVAILABLE_TOOLS>", "<TOOLCALL>[")),
        (QB, "<tool_response>\nsunny\n</tool_response>", ("<tools>", "<function=")),
    ],
    ids=["nemotron_json", "qwen3_coder"],
)
def test_history_is_written_in_the_format_it_is_read_in(
    parser: Any, result_block: str, described: tuple[str, str]
) -> None:
    """An agent's history for a template that does not render it: the calls read back as the
    same calls (values of every type), consecutive results share one user turn."""
    args = {"city": "Oslo", "nights": 2, "guests": ["Ann"]}
    history = [
        {"role": "user", "content": "Weather and time?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "book", "arguments": json.dumps(args)}},
                {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "sunny"},
    ]
    out = with_tool_history_as_text(history, parser, calls=True, results=True)
    assert _qcalls(parser, out[1]["content"]) == [("book", args), ("now", {})]
    assert out[2] == {"role": "user", "content": f"{result_block}\n{result_block}"} and len(out) == 3
    system = with_tools_in_system_prompt([{"role": "user", "content": "hi"}], parser, QTOOLS)[0]["content"]
    assert all(marker in system for marker in described) and '"book"' in system


# ---- through a server ------------------------------------------------------------------------

# no free-text values: a forced call of it ends within a few tokens, whatever the model
RESERVE = {
    "type": "function",
    "function": {
        "name": "reserve",
        "parameters": {
            "type": "object",
            "properties": {
                "nights": {"type": "integer"},
                "room": {"enum": ["single", "double"]},
                "breakfast": {"type": "boolean"},
            },
            "required": ["nights", "room"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize(
    "parser,described", [("nemotron_json", "AVAILABLE_TOOLS"), ("qwen3_coder", "<function=")]
)
def test_a_server_with_the_format_forces_and_reads_typed_calls(parser: str, described: str) -> None:
    """Forced calls (one of any tool, a named one, parallel ones) come back as calls of the
    format's parser with arguments typed by the schema, streamed and not alike; the tools are
    described in the format to the demo model, whose template does not render them."""
    messages = [{"role": "user", "content": "Book two nights in Oslo."}]
    with running_server("--dtype", "float32", "--tool-call-parser", parser) as server:
        status, tok = call(
            server, "/tokenize", {"messages": messages, "tools": [RESERVE], "return_token_strs": True}
        )
        assert status == 200 and described in "".join(tok["token_strs"])
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="none", max_retries=0)
        for seed, kw in enumerate(
            (
                {"tool_choice": "required", "parallel_tool_calls": False},
                {"tool_choice": {"type": "function", "function": {"name": "reserve"}}},
                {"tool_choice": {"type": "function", "function": {"name": "now"}}},
                {"tool_choice": "required"},
                # a text value ends within its maxLength (the demo model writes on otherwise)
                {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
            )
        ):
            body = {
                "model": "demo",
                "messages": messages,
                "tools": [RESERVE, NOW, WEATHER],
                "max_tokens": 200,
                "seed": seed,
                **kw,
            }
            full = client.chat.completions.create(**body).choices[0]
            if full.finish_reason == "length" and kw == {"tool_choice": "required"}:
                continue  # (up to 8 parallel calls may run out of tokens)
            assert full.finish_reason == "tool_calls" and full.message.content is None, full
            got = [(c.function.name, json.loads(c.function.arguments)) for c in full.message.tool_calls]
            for name, args in got:
                if name == "reserve":  # typed by the schema: an integer, a choice, a boolean
                    assert isinstance(args["nights"], int) and args["room"] in ("single", "double")
                    assert set(args) <= {"nights", "room", "breakfast"}
                    assert isinstance(args.get("breakfast", False), bool)
                elif name == "get_weather":
                    assert set(args) == {"city"} and isinstance(args["city"], str) and len(args["city"]) <= 10
                else:
                    assert (name, args) == ("now", {})
            if kw.get("parallel_tool_calls") is False or isinstance(kw["tool_choice"], dict):
                assert len(got) == 1
            if isinstance(kw["tool_choice"], dict):
                assert got[0][0] == kw["tool_choice"]["function"]["name"]
            content, calls, finish = stream_chat(client, **body)
            assert (content, finish) == (None, "tool_calls")
            assert [(c["name"], c["arguments"]) for c in calls] == [
                (c.function.name, c.function.arguments) for c in full.message.tool_calls
            ]
            if kw == {"tool_choice": {"type": "function", "function": {"name": "now"}}}:
                # the client's own accumulation of the chunks: a message of calls alone has no
                # content, as unstreamed (its first chunk says null, not "")
                with client.chat.completions.stream(**body) as events:
                    final = events.get_final_completion().choices[0]
                assert final.message.content is None and final.message.tool_calls


# ---- tool schemas with definitions ---------------------------------------------------------------


def test_forced_calls_of_tools_whose_schemas_have_definitions() -> None:
    """The openai client's `pydantic_function_tool` writes nested models as `$defs` with
    `#/$defs/Name` refs, and a recursive schema refers to its own root (`#`): inside a call's
    grammar those refs must still reach them, in every format."""

    class Address(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=10)

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=10)
        home: Address

    person = openai.pydantic_function_tool(Person)
    assert "$defs" in person["function"]["parameters"]
    tree = {
        "type": "function",
        "function": {
            "name": "tree",
            "parameters": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
                "required": ["kids"],
                "additionalProperties": False,
            },
        },
    }
    tools = parse_tools([person, tree])
    good = {"name": "Ann", "home": {"city": "Oslo"}}
    bad = {"name": "Ann", "home": {"town": "Oslo"}}
    texts = {
        "hermes": lambda n, a: f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>",
        "nemotron_json": lambda n, a: f"<TOOLCALL>{json.dumps([{'name': n, 'arguments': a}])}</TOOLCALL>",
        "qwen3_coder": lambda n, a: _qcall(
            n, **{k: v if isinstance(v, str) else json.dumps(v) for k, v in a.items()}
        ),
    }
    for name, write in texts.items():
        parser = TOOL_PARSERS[name].for_tools(tools)
        grammar = parser.grammar(tools, "required", False)
        for tool, args, ok in (
            ("Person", good, True),
            ("Person", bad, False),
            ("tree", {"kids": [{"kids": []}, {"kids": [{"kids": []}]}]}, True),
            ("tree", {"kids": [{"leaves": []}]}, False),
        ):
            text = write(tool, args)
            assert _accepts(grammar, text)[0] is ok, (name, text)
            if ok:
                assert [(c.name, json.loads(c.arguments)) for c in split_message(parser, text)[1]] == [
                    (tool, args)
                ]


def test_a_block_nested_too_deep_to_read_is_content() -> None:
    """JSON nested deeper than Python reads is not a call (and not a server error) in any format."""
    deep = "[" * 100000
    for name, text in (
        ("hermes", f"<tool_call>\n{deep}\n</tool_call>"),
        ("hermes", f'<tool_call>\n{{"name": "now", "arguments": "{deep}"}}\n</tool_call>'),
        ("nemotron_json", f"<TOOLCALL>{deep}</TOOLCALL>"),
        ("qwen3_coder", _qcall("book", guests=deep)),
    ):
        content, calls = split_message(TOOL_PARSERS[name].for_tools(QTOOLS), text)
        if name == "qwen3_coder":  # (a value that does not read stays text)
            assert [json.loads(c.arguments) for c in calls] == [{"guests": deep}]
        else:
            assert (content, calls) == (text, [])


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_parallel_tool_calls_false_reads_one_call(name: str) -> None:
    """`parallel_tool_calls: false` means at most one call, also for "auto", where no grammar
    holds the model to it: the first call is kept and the later ones dropped, streamed and not."""
    info = TokenizerModelInfo(ensure_demo_model(), max_model_len=512)
    info.tool_call_parser = name  # type: ignore[attr-defined]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [RESERVE, NOW]}
    many = protocol.parse_chat_request(body, info, "demo").tool_parser
    one = protocol.parse_chat_request({**body, "parallel_tool_calls": False}, info, "demo").tool_parser
    assert isinstance(one, FirstCallOnly) and not isinstance(many, FirstCallOnly)
    assert one.name == many.name == name
    write = {
        "hermes": lambda n: f'<tool_call>\n{{"name": "{n}", "arguments": {{}}}}\n</tool_call>',
        "nemotron_json": lambda n: f'<TOOLCALL>[{{"name": "{n}", "arguments": {{}}}}]</TOOLCALL>',
        "qwen3_coder": lambda n: _qcall(n),
    }[name]
    text = f"Sure. {write('now')} then {write('reserve')}"
    assert [c.name for c in split_message(many, text)[1]] == ["now", "reserve"]
    assert [c.name for c in split_message(one, text)[1]] == ["now"]
    assert split_message(one, text)[0] == "Sure.  then "
    assert_stream_adds_up(one, text)


def test_definitions_of_both_kinds_an_id_and_refs_as_data() -> None:
    """`definitions` and `$defs` may share a name (each ref keeps its own), a schema with an `$id`
    still finds its definitions, a `$ref` inside a `const` is data, and a qwen3_coder parameter
    that refers to a string enum is written as text, as a plain string parameter is."""
    schema = {
        "$id": "https://example.com/args",
        "type": "object",
        "properties": {
            "a": {"$ref": "#/definitions/A"},
            "b": {"$ref": "#/$defs/A"},
            "c": {"const": {"$ref": "#"}},
            "color": {"$ref": "#/$defs/Color"},
        },
        "required": ["a", "b", "c", "color"],
        "additionalProperties": False,
        "definitions": {"A": {"type": "string"}},
        "$defs": {"A": {"type": "integer"}, "Color": {"enum": ["red", "blue"], "type": "string"}},
    }
    tools = parse_tools([{"type": "function", "function": {"name": "f", "parameters": schema}}])
    args = {"a": "x", "b": 1, "c": {"$ref": "#"}, "color": "red"}
    hermes = TOOL_PARSERS["hermes"].grammar(tools, "f", False)
    assert _accepts(hermes, f"<tool_call>\n{json.dumps({'name': 'f', 'arguments': args})}\n</tool_call>")[0]
    wrong = {**args, "a": 1, "b": "x"}
    assert not _accepts(
        hermes, f"<tool_call>\n{json.dumps({'name': 'f', 'arguments': wrong})}\n</tool_call>"
    )[0]
    qwen = TOOL_PARSERS["qwen3_coder"].for_tools(tools)
    # (a refers to a string: text, in the grammar and as read back)
    text = _qcall("f", a="x", b="1", c='{"$ref": "#"}', color="red")
    assert _accepts(qwen.grammar(tools, "f", False), text) == (True, "")
    assert [json.loads(c.arguments) for c in split_message(qwen, text)[1]] == [args]


@pytest.mark.parametrize("name", ["hermes", "nemotron_json"])
def test_a_closing_tag_inside_a_json_string_does_not_end_the_block(name: str) -> None:
    """Arguments may hold the format's closing tag as text (code, markup): the block ends at the
    first closing tag outside a JSON string, in one piece and streamed in pieces. Escaped quotes
    inside the string do not end it."""
    parser = TOOL_PARSERS[name]
    args = {"code": f'print("{parser.END}")  # \\"{parser.END}\\" and \\\\', "n": 1}
    one = {"name": "run", "arguments": args}
    block = parser.render_calls([one])
    for text in (block, f"Before. {block} after {parser.END} done", f"{block}\n{block}"):
        content, calls = split_message(parser, text)
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("run", args)] * text.count(
            parser.START
        )
        assert (content or "").strip() == text.replace(block, "").strip()
        assert_stream_adds_up(parser, text)
    # unfinished: the string is still open at the tag, so the call has not ended
    cut = block[: block.index(parser.END) + len(parser.END)]
    assert split_message(parser, cut) == (cut, [])


# ------------------------------------------------------------------------- odd but valid outputs

H = TOOL_PARSERS["hermes"]


def _hermes(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def test_arguments_are_strict_utf8_json_or_the_block_is_text() -> None:
    """A lone surrogate escape ("\\ud800", valid JSON) stays an escape (no UTF-8 text holds the
    character); numbers JSON cannot write back (1e999, NaN, Infinity) make the block text, as any
    block that does not read as a call: `arguments` is always JSON a client's parser takes."""
    content, calls = split_message(H, _hermes('{"name": "f", "arguments": {"x": "\\ud800", "y": "é"}}'))
    (call_,) = calls
    call_.arguments.encode("utf-8")
    assert json.loads(call_.arguments) == {"x": "\ud800", "y": "é"} and not content
    for bad in ('{"n": 1e999}', '{"n": NaN}', '{"n": -Infinity}'):
        text = _hermes(f'{{"name": "f", "arguments": {bad}}}')
        assert split_message(H, text) == (text, [])
    text = _hermes('{"name": "f\\ud800", "arguments": {}}')  # (a name is never an escape)
    assert split_message(H, text) == (text, [])
    nemotron = '<TOOLCALL>[{"name": "f", "arguments": {"n": 1e999}}]</TOOLCALL>'
    assert split_message(P, nemotron)[1] == []
    q = TOOL_PARSERS["qwen3_coder"].for_tools(
        parse_tools([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"v": {"type": "object"}, "s": {"type": "string"}}}}}])
    )  # fmt: skip
    ((_, args),) = _qcalls(q, _qcall("f", v='{"n": 1e999}', s="\\ud800"))
    assert args == {"v": '{"n": 1e999}', "s": "\\ud800"}  # (what does not read stays text)


def test_a_forced_call_s_arguments_are_an_object_whatever_the_schema_leaves_open() -> None:
    for params in ({}, {"properties": {"x": {"type": "integer"}}}):
        tools = parse_tools([{"type": "function", "function": {"name": "ping", "parameters": params}}])
        grammar = H.grammar(tools, "ping", False)
        assert _accepts(grammar, _hermes('{"name": "ping", "arguments": {}}'))[0]
        assert not _accepts(grammar, _hermes('{"name": "ping", "arguments": "world"}'))[0]
    # a list of types that allows null too: null arguments would read as no call
    tools = parse_tools(
        [{"type": "function", "function": {"name": "ping", "parameters": {"type": ["object", "null"]}}}]
    )
    for grammar, null in (
        (H.grammar(tools, "ping", False), _hermes('{"name": "ping", "arguments": null}')),
        (P.grammar(tools, "required", True), '<TOOLCALL>[{"name": "ping", "arguments": null}]</TOOLCALL>'),
    ):
        assert not _accepts(grammar, null)[0]
    assert _accepts(H.grammar(tools, "ping", False), _hermes('{"name": "ping", "arguments": {}}'))[0]
    with pytest.raises(ToolError, match=r"parameters.type"):
        parse_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}])
    # OpenAI's `strict`: the forced call's arguments have the schema's properties and no others
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    extra = _hermes('{"name": "f", "arguments": {"x": 1, "y": 2}}')
    for strict, takes_extra in ((False, True), (True, False)):
        fn = {"name": "f", "parameters": schema, "strict": strict}
        tools = parse_tools([{"type": "function", "function": fn}])
        assert tools[0]["function"]["strict"] is strict
        assert _accepts(H.grammar(tools, "f", False), extra)[0] is takes_extra


def test_qwen3_coder_reads_optional_and_referenced_strings_as_text() -> None:
    """As vLLM types them: Optional[str] (anyOf a string and null) and a `$ref` to a string are
    text, digits and all; no type at all is text too; a root `$ref` (a pydantic model) is
    followed for the parameters, required ones included in the forced grammar."""
    schema = {
        "type": "object",
        "properties": {
            "query": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
            "zip": {"$ref": "#/$defs/Zip"},
            "free": {"description": "no type"},
            "count": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        },
        "$defs": {"Zip": {"type": "string"}},
    }
    tools = parse_tools([{"type": "function", "function": {"name": "search", "parameters": schema}}])
    q = TOOL_PARSERS["qwen3_coder"].for_tools(tools)
    text = _qcall("search", query="12345", zip="007", free="true", count="3")
    assert _qcalls(q, text) == [("search", {"query": "12345", "zip": "007", "free": "true", "count": 3})]
    assert _qcalls(q, _qcall("search", query="null", count="null")) == [
        ("search", {"query": None, "count": None})
    ]
    assert _accepts(q.grammar(tools, "search", False), text)[0]
    rooted = {
        "$ref": "#/$defs/A",
        "$defs": {"A": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
    }
    tools = parse_tools([{"type": "function", "function": {"name": "f", "parameters": rooted}}])
    q = TOOL_PARSERS["qwen3_coder"].for_tools(tools)
    grammar = q.grammar(tools, "f", False)
    assert _accepts(grammar, _qcall("f", x="4"))[0] and not _accepts(grammar, _qcall("f"))[0]
    assert _qcalls(q, _qcall("f", x="4")) == [("f", {"x": 4})]


def test_a_block_whose_json_leaves_a_string_open_is_text_and_the_calls_after_it_count() -> None:
    good = _hermes('{"name": "g", "arguments": {}}')
    text = f'<tool_call>{{"name": "f", "arguments": {{"s": "x}}}}</tool_call>\nOK then {good} bye'
    content, calls = split_message(H, text)
    assert [c.name for c in calls] == ["g"]
    assert content.startswith('<tool_call>{"name": "f"') and content.endswith(" bye")


@pytest.fixture(scope="module")
def tagged_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model with `<tool_call>` an added token and `</tool_call>`, `<TOOLCALL>`,
    `</TOOLCALL>` added special tokens."""
    tags = {"<tool_call>": False, "</tool_call>": True, "<TOOLCALL>": False, "</TOOLCALL>": True}
    return demo_with_added_tags(tmp_path_factory.mktemp("tagged") / "demo", tags)


@pytest.mark.parametrize("name", ["hermes", "nemotron_json", "qwen3_coder"])
def test_forced_grammar_writes_tags_that_are_added_tokens_as_those_tokens(
    tagged_demo: Path, name: str
) -> None:
    """A tag that is one of the tokenizer's added tokens is written as that token: the grammar
    takes the tokens the tokenizer gives the call's text (as a model writes it), and llguidance,
    given the tag as text, allowed that token and then refused it."""
    tokenizer = Tokenizer(tagged_demo)
    tok = llguidance.LLTokenizer((tagged_demo / "tokenizer.json").read_text(), eos_token=2)
    tools = parse_tools([WEATHER])
    parser = TOOL_PARSERS[name].for_tools(tools)
    text = parser.render_calls([{"name": "get_weather", "arguments": {"city": "Paris"}}])
    ids = tokenizer.encode(text)
    assert tokenizer.added_token_ids[parser.START] in ids  # type: ignore[attr-defined]
    for added in (tokenizer.added_token_ids, {}):
        grammar = llguidance.grammar_from("grammar", parser.grammar(tools, "required", False, added))
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        took = bool(m.consume_tokens(ids) and m.is_accepting())
        assert took == bool(added), (added, m.get_error())


def test_a_server_whose_tags_are_added_tokens_forces_calls_and_reads_them(tagged_demo: Path) -> None:
    """Through the server: forced calls in a format whose opening tag is an added token and
    whose closing tag a special one (left out of the text by default, kept here so that the call
    is read) come back as calls, streamed and not; they were a 500 (the grammar's error)."""
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    with running_server(
        "--dtype", "float32", "--served-model-name", "demo", model=str(tagged_demo)
    ) as server:
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="none", max_retries=0)
        for kw in (
            {"tool_choice": "required", "parallel_tool_calls": False},
            {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        ):
            body = {
                "model": "demo",
                "messages": messages,
                "tools": [WEATHER],
                "max_tokens": 60,
                "seed": 1,
                **kw,
            }
            full = client.chat.completions.create(**body).choices[0]
            assert full.finish_reason == "tool_calls" and full.message.content is None, full
            [got] = full.message.tool_calls
            assert got.function.name == "get_weather"
            assert set(json.loads(got.function.arguments)) == {"city"}
            content, calls, finish = stream_chat(client, **body)
            assert (content, finish) == (None, "tool_calls")
            assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", got.function.arguments)]
        # a client that asks for the special tokens to be left out gets the text it asked for
        body = {"model": "demo", "messages": messages, "tools": [WEATHER], "max_tokens": 60}
        out = client.chat.completions.create(
            **body, tool_choice="required", extra_body={"skip_special_tokens": True}
        )
        assert out.choices[0].message.tool_calls is None and "</tool_call>" not in (
            out.choices[0].message.content or ""
        )
