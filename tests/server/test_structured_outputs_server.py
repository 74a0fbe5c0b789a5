"""Structured outputs and tool calls through the real server (demo model, the official openai
client): `response_format` (a pydantic model through `parse`, json_schema, json_object), vLLM's
`structured_outputs` (regex, choice, grammar), `tools` with `tool_choice`, streaming against
non-streaming, the 400s of bad grammars, and a grammar that compiles too slowly while other
requests run. docs/structured-outputs.md, docs/serving.md."""

from __future__ import annotations

import concurrent.futures
import json
import re
import time
from collections.abc import Iterator
from typing import Annotated, Any

import openai
import pydantic
import pytest

from hybridserve.model.demo import ensure_demo_model
from server_fixtures import ServerProcess, openai_client, running_server
from tool_formats import TIME, WEATHER

# A short compile limit, so that the slow-grammar test is quick: its grammar takes about 4.5 s on
# this machine, every other grammar here milliseconds (a first one, which builds the tokenizer's
# tables, up to ~0.2 s while other threads compete for the cores). A refusal is cached: one normal
# grammar over the limit would fail every later request of its schema.
SERVER_ARGS = ("--grammar-compile-timeout", "1", "--max-num-seqs", "16")


class Person(pydantic.BaseModel):
    """Bounded fields and no others (additionalProperties false): the output's language is finite,
    so the grammar forces it to end."""

    model_config = pydantic.ConfigDict(extra="forbid")

    name: Annotated[str, pydantic.StringConstraints(max_length=12)]
    age: Annotated[int, pydantic.Field(ge=0, le=120)]
    member: bool


MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    ensure_demo_model()
    with running_server(*SERVER_ARGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai_client(server) as c:
        yield c


def _parse(client: openai.OpenAI, **kw: Any) -> Any:
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    return parse(**kw)


def test_parse_pydantic_model_100_of_100(client: openai.OpenAI) -> None:
    def one(seed: int) -> Person:
        r = _parse(
            client,
            model="demo",
            messages=[{"role": "user", "content": f"Describe person number {seed}."}],
            response_format=Person,
            max_tokens=80,
            seed=seed,
            temperature=1.0,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Person), choice.message.content
        return choice.message.parsed

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        people = list(pool.map(one, range(100)))
    assert len(people) == 100
    assert len({p.model_dump_json() for p in people}) > 1  # seeds differ, outputs differ


def test_response_format_json_schema_and_json_object(client: openai.OpenAI) -> None:
    schema = Person.model_json_schema()
    r = client.chat.completions.create(
        model="demo",
        messages=MESSAGES,
        max_tokens=80,
        seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )
    Person.model_validate_json(r.choices[0].message.content or "")
    r = client.completions.create(
        model="demo",
        prompt="Order:",
        max_tokens=80,
        seed=2,
        extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
        },
    )
    Person.model_validate_json(r.choices[0].text)
    r = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=10, temperature=0, response_format={"type": "json_object"}
    )
    assert (r.choices[0].message.content or "").startswith("{")


def _grammar(form: str, key: str, value: Any) -> dict[str, Any]:
    """vLLM's `structured_outputs: {key: value}`, or its older `guided_<key>: value`."""
    return {"structured_outputs": {key: value}} if form == "structured_outputs" else {f"guided_{key}": value}


@pytest.mark.parametrize("form", ["structured_outputs", "guided"])
def test_json_regex_choice_grammar(client: openai.OpenAI, form: str) -> None:
    """vLLM's `structured_outputs`, and the `guided_*` fields that clients written for vLLM before
    it still send (ignoring them would answer unconstrained)."""
    # (vLLM takes the schema's JSON text too, in either form)
    schemas: list[Any] = [Person.model_json_schema(), json.dumps(Person.model_json_schema())]
    for schema in schemas:
        r = client.chat.completions.create(
            model="demo", messages=MESSAGES, max_tokens=80, seed=6, extra_body=_grammar(form, "json", schema)
        )
        Person.model_validate_json(r.choices[0].message.content or "")
    r = client.completions.create(
        model="demo",
        prompt="Code:",
        max_tokens=20,
        seed=3,
        extra_body=_grammar(form, "regex", r"[A-Z]{3}-\d{2,4}"),
    )
    assert re.fullmatch(r"[A-Z]{3}-\d{2,4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(
        model="demo",
        messages=MESSAGES,
        max_tokens=20,
        seed=4,
        extra_body=_grammar(form, "choice", ["sunny", "rain"]),
    )
    assert r.choices[0].message.content in ("sunny", "rain")
    lark = 'start: "temp=" /[0-9]{1,2}/ "C"'
    r = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=20, seed=5, extra_body=_grammar(form, "grammar", lark)
    )
    assert re.fullmatch(r"temp=[0-9]{1,2}C", r.choices[0].message.content or "")


def test_guided_fields_errors_name_the_field(client: openai.OpenAI) -> None:
    assert client.chat.completions.create(  # (the older option: accepted, changes nothing)
        model="demo", messages=MESSAGES, max_tokens=2, extra_body={"guided_decoding_backend": "xgrammar"}
    ).choices
    for body, param in (
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": [1]}, "guided_json"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"structured_outputs": {"json": "[1]"}}, "structured_outputs.json"),
        ({"guided_regex": "[a-z]+", "guided_choice": ["x"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "guided_regex"),
        ({"guided_decoding_backend": 3}, "guided_decoding_backend"),
        ({"guided_regex": "a", "use_beam_search": True, "n": 2}, "guided_regex"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=5, extra_body=body)
        assert e.value.body["param"] == param, (body, e.value.body)


def _tool_call(client: openai.OpenAI, **kw: Any) -> Any:
    return client.chat.completions.create(model="demo", messages=MESSAGES, **{"max_tokens": 150, **kw})


def test_tool_choice_required_and_named(client: openai.OpenAI) -> None:
    for seed in range(5):
        r = _tool_call(
            client, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, seed=seed
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f") and len(args["city"]) <= 10
        else:
            assert call.function.name == "get_time" and -12 <= args["zone"] <= 12
    r = _tool_call(
        client,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        seed=7,
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and r.choices[0].finish_reason == "tool_calls"
    # parallel calls allowed: one or more, all valid, when the output ends in time
    r = _tool_call(client, tools=[WEATHER], tool_choice="required", seed=8, max_tokens=400)
    if r.choices[0].finish_reason == "tool_calls":
        assert all(c.function.name == "get_weather" for c in r.choices[0].message.tool_calls)
    # "none": the tools are not offered and nothing is parsed; "auto": text or calls, parsed
    r = _tool_call(client, tools=[WEATHER], tool_choice="none", seed=1, max_tokens=10)
    assert r.choices[0].message.tool_calls is None
    r = _tool_call(client, tools=[WEATHER], seed=1, max_tokens=10)
    assert r.choices[0].finish_reason in ("stop", "length")


def _stream(client: openai.OpenAI, **kw: Any) -> tuple[str | None, list[dict[str, Any]], str | None]:
    content = ""
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in client.chat.completions.create(model="demo", messages=MESSAGES, stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                if tc.id:
                    assert "id" not in slot  # the id comes once, with the name
                    slot["id"] = tc.id
                if tc.function and tc.function.name:
                    slot["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    slot["arguments"] += tc.function.arguments
            finish = ch.finish_reason or finish
    return (content or None), [calls[i] for i in sorted(calls)], finish


def test_streaming_agrees_with_non_streaming(client: openai.OpenAI) -> None:
    for kw in (
        {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False, "seed": 11},
        {"tools": [WEATHER], "tool_choice": "required", "seed": 12, "max_tokens": 90},  # may end by length
        {"tools": [WEATHER], "seed": 13, "max_tokens": 40},  # auto: text
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": Person.model_json_schema()},
            },
            "seed": 14,
        },
        {"extra_body": {"structured_outputs": {"regex": "(ab|cd){2,6}"}}, "seed": 15},
    ):
        kw = {"max_tokens": 150, **kw}
        full = client.chat.completions.create(model="demo", messages=MESSAGES, **kw).choices[0]
        content, calls, finish = _stream(client, **kw)
        assert content == full.message.content
        assert finish == full.finish_reason
        expected = [
            {"name": c.function.name, "arguments": c.function.arguments}
            for c in full.message.tool_calls or []
        ]
        assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == expected
        assert all(c["id"].startswith("call_") for c in calls)


def _error(call: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    body = info.value.body
    assert isinstance(body, dict) and set(body) == {"message", "type", "param", "code"}
    return body


def test_a_strict_pydantic_model_with_unchecked_formats_parses(client: openai.OpenAI) -> None:
    """pydantic writes `format: "path"` for a Path and `"password"` for a SecretStr: the grammar
    leaves such a string free (JSON Schema's formats are annotations) instead of refusing the
    model; the client's `parse` sends `strict`, and the answer has the model's fields alone."""
    import pathlib

    class Saved(pydantic.BaseModel):
        where: pathlib.Path
        secret: pydantic.SecretStr
        done: bool

    try:
        r = _parse(client, model="demo", messages=MESSAGES, response_format=Saved, max_tokens=120, seed=3)
    except openai.LengthFinishReasonError:
        pass  # (served: the demo model's free strings may run to max_tokens; a refusal is a 400)
    else:
        assert set(json.loads(r.choices[0].message.content)) == {"where", "secret", "done"}
    e = _error(
        lambda: client.chat.completions.create(
            model="demo", messages=MESSAGES, extra_body={"structured_outputs": {"structural_tag": "{}"}}
        )
    )
    assert e["param"] == "structured_outputs.structural_tag" and e["code"] == "unsupported_parameter"


def test_bad_grammars_are_400s_that_name_the_field(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create
    e = _error(
        lambda: chat(
            model="demo",
            messages=MESSAGES,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            },
        )
    )
    assert e["param"] == "response_format" and "invalid JSON schema" in e["message"]
    e = _error(
        lambda: chat(
            model="demo", messages=MESSAGES, extra_body={"structured_outputs": {"regex": "(unclosed"}}
        )
    )
    assert e["param"] == "structured_outputs" and "invalid regex" in e["message"]
    e = _error(
        lambda: chat(
            model="demo",
            messages=MESSAGES,
            extra_body={"structured_outputs": {"grammar": "start: missing_rule"}},
        )
    )
    assert e["param"] == "structured_outputs" and "invalid grammar" in e["message"]
    e = _error(
        lambda: chat(
            model="demo",
            messages=MESSAGES,
            extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}},
        )
    )
    assert e["param"] == "structured_outputs" and "exactly one" in e["message"]
    e = _error(lambda: chat(model="demo", messages=MESSAGES, response_format={"type": "xml"}))  # type: ignore[arg-type, typeddict-item]
    assert e["param"] == "response_format.type"
    e = _error(
        lambda: chat(
            model="demo",
            messages=MESSAGES,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    )
    assert e["param"] == "tool_choice.function.name"
    e = _error(lambda: chat(model="demo", messages=MESSAGES, tool_choice="required"))
    assert e["param"] == "tool_choice"
    e = _error(
        lambda: chat(
            model="demo",
            messages=MESSAGES,
            tools=[WEATHER],
            tool_choice="required",
            response_format={"type": "json_object"},
        )
    )
    assert e["param"] == "tool_choice" and "response_format" in e["message"]
    bad_tool = {"type": "function", "function": {"name": ""}}
    e = _error(lambda: chat(model="demo", messages=MESSAGES, tools=[bad_tool]))
    assert e["param"] == "tools[0].function.name"


# A grammar that compiles (and gives its first mask) but hits a limit of the grammar library (its
# parser's items) a few tokens in
RECURSIVE_SCHEMA = {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}


def test_a_grammar_too_large_to_follow_is_a_400_that_names_the_field(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create
    for stream in (False, True):

        def ask(stream: bool = stream) -> None:
            answer = chat(
                model="demo",
                messages=MESSAGES,
                max_tokens=20,
                stream=stream,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": RECURSIVE_SCHEMA},
                },
            )
            if stream:  # (the error comes before the first chunk: it is the answer's status)
                list(answer)  # type: ignore[arg-type]

        e = _error(ask)
        assert e["param"] == "response_format" and "too large to follow" in e["message"], e
        assert e["type"] == "invalid_request_error"
    # the server goes on
    assert chat(model="demo", messages=MESSAGES, max_tokens=3).choices[0].finish_reason == "length"


def test_a_grammar_that_spells_an_added_token_is_a_400_that_names_it(client: openai.OpenAI) -> None:
    """The grammar library allows an added token whose text a literal of the grammar spells, then
    refuses it: the client's grammar is at fault, and the answer says which token, not a 500."""
    for so in ({"choice": ["<|im_start|>x"]}, {"regex": "ab<\\|im_start\\|>x"}):
        e = _error(
            lambda so=so: client.completions.create(
                model="demo", prompt="Hi", max_tokens=8, temperature=0, extra_body={"structured_outputs": so}
            )
        )
        assert e["type"] == "invalid_request_error" and e["param"] == "structured_outputs", e
        assert "added token 1 ('<|im_start|>')" in e["message"], e
    out = client.completions.create(
        model="demo", prompt="Hi", max_tokens=8, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}
    )
    assert out.choices[0].text in ("yes", "no")


def _slow_schema() -> dict[str, Any]:
    """A JSON schema whose compilation takes seconds: thousands of optional properties (the
    grammar of their orders grows with their square; short names keep it within the size the
    server takes)."""
    props = {f"f{i}": {"type": "integer"} for i in range(8000)}
    return {"type": "object", "properties": props, "additionalProperties": False}


def test_slow_grammar_is_refused_while_others_are_served(client: openai.OpenAI) -> None:
    slow_body = {"type": "json_schema", "json_schema": {"name": "slow", "schema": _slow_schema()}}

    def slow() -> tuple[dict[str, Any], float]:
        t0 = time.monotonic()
        body = _error(
            lambda: client.chat.completions.create(
                model="demo", messages=MESSAGES, max_tokens=5, response_format=slow_body
            )
        )  # type: ignore[arg-type]
        return body, time.monotonic() - t0

    def normal(i: int) -> tuple[str, float]:
        t0 = time.monotonic()
        kw: dict[str, Any] = {"extra_body": {"structured_outputs": {"choice": ["x", "y"]}}} if i % 2 else {}
        r = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=30, seed=i, **kw)
        return r.choices[0].finish_reason or "", time.monotonic() - t0

    # the choice grammar compiled once before (its compile would otherwise race the slow one's
    # for the cores, within the short limit, on a loaded machine)
    assert normal(1)[0] in ("stop", "length")
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        slow_f = pool.submit(slow)
        time.sleep(0.05)
        normal_f = [pool.submit(normal, i) for i in range(5)]
        body, slow_s = slow_f.result(timeout=60)
        finished = [f.result(timeout=60) for f in normal_f]
    assert body["param"] == "response_format" and "took longer than 1 s" in body["message"]
    assert slow_s < 10.0
    assert all(reason in ("stop", "length") for reason, _ in finished)
    # the same grammar again: refused without compiling it again
    t0 = time.monotonic()
    body2, _ = slow()
    assert "took longer" in body2["message"] and time.monotonic() - t0 < 10.0


def test_multi_turn_tool_calling_loop(client: openai.OpenAI) -> None:
    """The openai client's agent loop: a call, the assistant message sent back as returned with a
    tool result, then an answer."""
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(
        model="demo",
        messages=messages,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=150,
        seed=11,
    )
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls
    messages.append(msg)
    for call in msg.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp": 21})})
    r = client.chat.completions.create(
        model="demo", messages=messages, tools=[WEATHER], max_tokens=10, seed=3
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage is not None and r.usage.completion_tokens > 0
