"""Tool calls on chat: the request's `tools` and `tool_choice`, how the tools reach the model, the
grammar that forces a call, and the parsers that find calls in the model's text.

- `parse_tools` / `parse_tool_choice` check the request fields (OpenAI's shapes).
- The chat template renders the tools when it knows them (it mentions `tools`: it gets them as
  the `tools` variable, as Hugging Face templates do); a template that ignores them (the demo
  model's ChatML) gets them written into the system prompt by the parser (`system_prompt`), in the
  format the parser reads back.
- `tool_choice` "required" or a named function is enforced by a grammar (`ToolParser.grammar`):
  the output is one call (named) or one or more calls (required) and nothing else, so even a model
  that would never call a tool returns a valid call. "auto" lets the model write text or calls;
  "none" leaves the tools out of the prompt and the output unparsed.
- A `ToolParser` turns the model's text into content and calls. `ToolCallStream` runs it over a
  growing text for streaming: content is sent as soon as it cannot be the start of a call, and a
  call is sent when it is complete (a first delta with its id, type and name, then one with its
  arguments, as OpenAI's deltas are shaped), so the streamed content and calls add up to the
  non-streamed message exactly.

Parsers are registered by name in `TOOL_PARSERS` (the server's `--tool-call-parser`): `hermes`
(the `<tool_call>{"name": ..., "arguments": ...}</tool_call>` format of ChatML models: Hermes,
Qwen), the default; `nemotron_json` (`<TOOLCALL>[{"name": ..., "arguments": ...}, ...]</TOOLCALL>`,
one block of a JSON list of calls, as NVIDIA's Nemotron-H instruct models write them); and
`qwen3_coder` (`<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>`,
the XML-like form of Qwen3-Coder and NVIDIA's Nemotron 3 models, whose values are text that the
tool's parameter schema types).
"""

from __future__ import annotations

import abc
import json
import math
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, Self

from hybridserve.sampling.structured_outputs import JSON_DEFAULTS, prepared_schema

MAX_TOOLS = 128
MAX_PARALLEL_CALLS = 8  # the most calls a forced ("required") output may hold
MAX_NAME_LEN = 64

ToolChoice = Literal["none", "auto", "required"] | str  # a str other than those three: a function name


class ToolError(ValueError):
    """A malformed `tools` / `tool_choice` (the message starts with the field's path)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: `arguments` is the JSON text of the arguments object."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _refuse(name: str) -> None:
    raise ToolError(name, "unknown field")


# OpenAI's rule for a function's name, with the dot that MCP tools' names carry
# (`github.create_issue`): its characters (a regex class), also the API document's. It is what keeps
# a name from writing markup of its own into the prompt (`</tools>`, `<tool_call>`), where the
# templates put it as it is.
NAME_CHARS = "A-Za-z0-9_.-"
_NAME = re.compile(f"[{NAME_CHARS}]{{1,{MAX_NAME_LEN}}}")


def _name_ok(name: Any) -> bool:
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def _unwritable(value: Any) -> str | None:
    """Why a tool's string or parsed JSON cannot go into the prompt as UTF-8 text, or None: an
    unpaired surrogate (JSON's "\ud800" escapes, which no tokenizer encodes), or nesting deeper
    than the encoder writes back."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return "contains an unpaired UTF-16 surrogate"
    except RecursionError:
        return "is nested too deeply"
    return None


def parse_tools(v: Any, on_unknown: Callable[[str], None] = _refuse) -> list[dict[str, Any]]:
    """The `tools` list, checked: [{"type": "function", "function": {"name" (1 to 64
    letters, digits, `_`, `-` or `.`), "description"?, "parameters"?, "strict"?}}]. Returned in the same shape (what
    templates expect). `on_unknown` gets the path of a field it does not know (raises to refuse)."""
    if not isinstance(v, list):
        raise ToolError("tools", f"must be a list of tool objects, got {type(v).__name__}")
    if len(v) > MAX_TOOLS:
        raise ToolError("tools", f"at most {MAX_TOOLS} tools")
    out: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, t in enumerate(v):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise ToolError(p, f"must be an object, got {type(t).__name__}")
        for key in t:
            if key not in ("type", "function"):
                on_unknown(f"{p}.{key}")
        if t.get("type") != "function":
            raise ToolError(f"{p}.type", f"must be 'function', got {t.get('type')!r}")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"{p}.function", "must be an object")
        for key in fn:
            if key not in ("name", "description", "parameters", "strict"):
                on_unknown(f"{p}.function.{key}")
        name = fn.get("name")
        if not isinstance(name, str) or not _name_ok(name):
            raise ToolError(
                f"{p}.function.name",
                f"must be 1 to {MAX_NAME_LEN} letters, digits, '_', '-' or '.' (a-z, A-Z, 0-9)",
            )
        if name in names:
            raise ToolError(f"{p}.function.name", f"{name!r} is given twice")
        names.add(name)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ToolError(f"{p}.function.description", "must be a string")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ToolError(f"{p}.function.parameters", "must be a JSON schema object")
        kind = params.get("type") if params is not None else None
        if kind is not None and "object" not in (kind if isinstance(kind, list) else [kind]):
            raise ToolError(
                f"{p}.function.parameters.type",
                f"must be 'object' (a function's arguments are an object), got {kind!r}",
            )
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ToolError(f"{p}.function.strict", "must be a boolean")
        for key, value in (("description", desc), ("parameters", params)):
            if value is not None and (why := _unwritable(value)) is not None:
                raise ToolError(f"{p}.function.{key}", why)
        if params is not None:
            # (what a grammar built from the schema refuses, refused here by name: a `pattern`
            # ending in a lone backslash reached the qwen3_coder parser's set-up as a 500)
            try:
                prepared_schema(params)
            except ValueError as e:
                raise ToolError(f"{p}.function.parameters", str(e)) from None
        clean: dict[str, Any] = {"name": name}
        if desc is not None:
            clean["description"] = desc
        # OpenAI: a function without parameters takes none (so a forced call of it ends at once)
        clean["parameters"] = (
            params
            if params is not None
            else {"type": "object", "properties": {}, "additionalProperties": False}
        )
        if strict is not None:  # (OpenAI's: a forced call's arguments take no other properties)
            clean["strict"] = strict
        out.append({"type": "function", "function": clean})
    return out


def parse_tool_choice(
    v: Any, tools: list[dict[str, Any]], on_unknown: Callable[[str], None] = _refuse
) -> ToolChoice:
    """The choice: "none", "auto", "required", or the name of the function the output must call. Without
    tools only "none" is possible (and the default); with tools "auto" is the default."""
    if v is None:
        return "auto" if tools else "none"
    if isinstance(v, str):
        if v not in ("none", "auto", "required"):
            raise ToolError("tool_choice", f"must be 'none', 'auto', 'required' or a function, got {v!r}")
        if v != "none" and not tools:
            raise ToolError("tool_choice", f"{v!r} needs tools")
        return v
    if not isinstance(v, dict):
        raise ToolError("tool_choice", f"must be a string or an object, got {type(v).__name__}")
    fn = v.get("function")
    if v.get("type") != "function" or not isinstance(fn, dict) or not _name_ok(fn.get("name")):
        raise ToolError("tool_choice", "a named choice is {'type': 'function', 'function': {'name': ...}}")
    for key in sorted(set(v) - {"type", "function"}):
        on_unknown(f"tool_choice.{key}")
    for key in sorted(set(fn) - {"name"}):
        on_unknown(f"tool_choice.function.{key}")
    name = fn["name"]
    if name not in {t["function"]["name"] for t in tools}:
        raise ToolError("tool_choice.function.name", f"no tool is named {name!r}")
    if name in ("none", "auto", "required"):
        raise ToolError("tool_choice.function.name", f"{name!r} cannot be named as a choice")
    return str(name)


class ToolParser(Protocol):
    """A tool-call format: how the tools are described to a model whose template ignores them,
    the grammar of a forced call, and how calls are found in text."""

    name: str

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        """The text that describes the tools and the call format (for the system message)."""
        ...

    def grammar(
        self, tools: list[dict[str, Any]], choice: str, parallel: bool, added: Mapping[str, int] = {}
    ) -> str:
        """A Lark grammar (llguidance's dialect) of an output that is only tool calls: one call of
        `choice` (a function name), or for "required" one call of any tool (up to
        MAX_PARALLEL_CALLS with `parallel`). `added`: the tokenizer's added tokens by their
        text; a tag that is one of them is written as that token (`_lark_text`)."""
        ...

    def scan(self, text: str, final: bool) -> tuple[list[str | ToolCall], int]:
        """The text as content pieces and complete calls, for its prefix that is settled: the
        second value is where that prefix ends. With `final` the whole text is settled (an
        unfinished or malformed call is content)."""
        ...

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        """An assistant's calls ({"name", "arguments"} objects) as the model writes them."""
        ...

    def result_block(self, content: str) -> str:
        """A tool's result as the model reads it in a user turn."""
        ...

    def for_tools(self, tools: list[dict[str, Any]]) -> ToolParser:
        """The parser a request with these tools reads its output with (a format whose values
        the tools' schemas type needs them; the others are the same parser)."""
        ...


# keywords whose values are data, not schemas: a "$ref" inside them is a value
_DATA_KEYWORDS = ("const", "enum", "default", "examples")


def _has_local_ref(node: Any) -> bool:
    if isinstance(node, dict):
        ref = node.get("$ref")
        return (isinstance(ref, str) and ref.startswith("#")) or any(
            _has_local_ref(v) for k, v in node.items() if k not in _DATA_KEYWORDS
        )
    return isinstance(node, list) and any(_has_local_ref(v) for v in node)


def _rooted(schema: Any, prefix: str) -> tuple[Any, dict[str, Any]]:
    """A tool's parameters schema made to work inside a larger one, whose root its `$ref`s would
    otherwise point at (pydantic writes nested models as `$defs` with `#/$defs/Name` refs): the
    schema goes to the root's `$defs` as `prefix`, its `$defs` and `definitions` as
    `prefix$defs.Name` and `prefix.definitions.Name` (two namespaces: the two may share a name),
    its local refs rewritten to them, and its `$id` / `$schema` dropped (refs would resolve
    against the `$id`). Returns (what to embed, the root's `$defs`); a schema without local refs
    or definitions is embedded as it is."""
    if not isinstance(schema, dict) or not (
        "$defs" in schema or "definitions" in schema or _has_local_ref(schema)
    ):
        return schema, {}
    spaces = {"$defs": f"{prefix}$defs.", "definitions": f"{prefix}.definitions."}

    def ref(r: str) -> str:
        if r == "#":
            return f"#/$defs/{prefix}"
        for key, space in spaces.items():
            if r.startswith(f"#/{key}/"):
                return f"#/$defs/{space}{r[len(key) + 3 :]}"
        return f"#/$defs/{prefix}{r[1:]}" if r.startswith("#/") else r

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {
                k: v if k in _DATA_KEYWORDS else ref(v) if k == "$ref" and isinstance(v, str) else walk(v)
                for k, v in node.items()
            }
        return [walk(v) for v in node] if isinstance(node, list) else node

    def resource(node: Any) -> Any:  # (as a part of the grammar's schema, not a document of its own)
        return (
            walk({k: v for k, v in node.items() if k not in ("$id", "$schema")})
            if isinstance(node, dict)
            else node
        )

    root = {prefix: resource({k: v for k, v in schema.items() if k not in spaces})}
    for key, space in spaces.items():
        if isinstance(schema.get(key), dict):
            root.update({f"{space}{name}": resource(d) for name, d in schema[key].items()})
    return {"$ref": f"#/$defs/{prefix}"}, root


def _with_defs(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "$defs": defs} if defs else schema


def _call_alternatives(tools: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The JSON schema of one call of any of `tools` ({"name", "arguments"}), and the `$defs` its
    root needs (`_rooted`)."""
    alternatives = []
    defs: dict[str, Any] = {}
    for i, t in enumerate(tools):
        params = prepared_schema(
            t["function"]["parameters"], closed_objects=t["function"].get("strict") is True
        )
        if isinstance(params, dict) and "type" not in params and "$ref" not in params:
            # ({} or properties without a type would take any JSON value: a call's arguments
            # are an object, and anything else is no call)
            params = {**params, "type": "object"}
        elif isinstance(params, dict) and isinstance(params.get("type"), list):
            # (a list of types, such as ["object", "null"], would let a forced call write null
            # or another value as its arguments, which reads as no call: only the object is one)
            params = {**params, "type": "object"}
        arguments, tool_defs = _rooted(params, f"tool{i}")
        defs.update(tool_defs)
        alternatives.append(
            {
                "type": "object",
                "properties": {"name": {"const": t["function"]["name"]}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return (alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}), defs


def _chosen(tools: list[dict[str, Any]], choice: str) -> list[dict[str, Any]]:
    return tools if choice == "required" else [t for t in tools if t["function"]["name"] == choice]


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"{text}: no JSON number holds it")
    return v


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def strict_loads(text: str) -> Any:
    """JSON as the standard has it: Python's reader also takes NaN and Infinity, and reads 1e999
    as inf, which no JSON text can write back (a client's parser refuses `Infinity`). Raises
    ValueError (or RecursionError) for what does not read."""
    return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)


def arguments_json(args: dict[str, Any]) -> str:
    """A call's arguments as JSON text for the client: UTF-8 as written, or with ASCII escapes
    where a string holds a lone surrogate (a model's "\ud800" escape, which no UTF-8 text can
    hold as a character: the escape is the same JSON value)."""
    text = json.dumps(args, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(args)
    return text


def _tool_call(obj: Any) -> ToolCall | None:
    """A {"name", "arguments"} object the model wrote as a call (arguments as an object, or as
    the JSON text of one, as some models write them; "parameters" as its other name). A name
    that is not UTF-8 text (a lone surrogate escape) is no call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or _unwritable(obj["name"]):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = strict_loads(args)
        except (ValueError, RecursionError):  # (not JSON, or nested too deep to read)
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name=obj["name"], arguments=arguments_json(args))


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _json_end(text: str, start: int, tag: str) -> int:
    """The first `tag` in `text` from `start` on that is not inside a JSON string (a call's
    arguments may hold the closing tag as text), or -1. A quote escaped by a backslash does not
    end a string. One pass: each tag and quote is found once."""
    in_string = False
    i = start
    j = text.find(tag, start)
    while j >= 0:
        q = text.find('"', i)
        if not in_string:
            if q < 0 or j < q:
                return j
        elif q < 0:
            return -1  # (inside a string that is not closed yet)
        else:
            k = q  # a quote after an odd number of backslashes is escaped
            while k > i and text[k - 1] == "\\":
                k -= 1
            if (q - k) % 2 == 1:
                i = q + 1
                continue
        in_string = not in_string
        i = q + 1
        if j < i:
            j = text.find(tag, i)
    return -1


def _lark_text(text: str, added: Mapping[str, int]) -> str:
    """`text` as a Lark expression: string literals, with each of the tokenizer's added tokens
    in it written as that token (`<[id]>`). llguidance turns a literal into tokens as the
    tokenizer does, added tokens included, and then refuses such a token, which it matches by id
    only, not as text: a tag like `<tool_call>` that is an added token (Qwen's, Granite's) made
    every forced call fail."""
    found = sorted((t for t in added if t and t in text), key=len, reverse=True)
    if not found:
        return json.dumps(text)
    pieces = re.split("(" + "|".join(map(re.escape, found)) + ")", text)
    return " ".join(f"<[{added[p]}]>" if i % 2 else json.dumps(p) for i, p in enumerate(pieces) if p)


class _TaggedToolParser(abc.ABC):
    """Calls written between START and END tags; a block that does not read as calls is content.
    A format gives its tags and how a block's body reads as calls (`_calls`). With `JSON_BODY`
    the block ends at the first END outside a JSON string."""

    name = ""
    START = ""
    END = ""
    JSON_BODY = False

    @abc.abstractmethod
    def _calls(self, body: str) -> list[ToolCall] | None:
        """The calls a block's body holds, or None when it does not read as calls."""

    def for_tools(self, tools: list[dict[str, Any]]) -> Self:
        return self

    def scan(self, text: str, final: bool) -> tuple[list[str | ToolCall], int]:
        items: list[str | ToolCall] = []
        pos = 0
        while True:
            i = text.find(self.START, pos)
            if i < 0:
                end = len(text) if final else len(text) - _held_prefix(text[pos:], self.START)
                items.append(text[pos:end])
                return items, end
            items.append(text[pos:i])
            body = i + len(self.START)
            j = _json_end(text, body, self.END) if self.JSON_BODY else text.find(self.END, body)
            if j < 0:
                k = text.find(self.END, body) if final and self.JSON_BODY else -1
                if k >= 0:
                    # (at the end, a block whose JSON leaves a string open is text up to its
                    # closing tag, and the calls after it still count)
                    items.append(text[i : k + len(self.END)])
                    pos = k + len(self.END)
                    continue
                if final:
                    # a last block without its closing tag (the client's stop string, a model
                    # that ends after the call) is calls when its body reads as calls, as vLLM
                    # reads it; an unfinished call is text
                    calls = self._calls(text[body:])
                    if calls:
                        items.extend(calls)
                    else:
                        items.append(text[i:])
                    return items, len(text)
                return items, i
            calls = self._calls(text[i + len(self.START) : j])
            if calls:
                items.extend(calls)
            else:
                items.append(text[i : j + len(self.END)])
            pos = j + len(self.END)


class HermesToolParser(_TaggedToolParser):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (Hermes, Qwen)."""

    name = "hermes"
    START = "<tool_call>"
    END = "</tool_call>"
    JSON_BODY = True

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )

    def grammar(
        self, tools: list[dict[str, Any]], choice: str, parallel: bool, added: Mapping[str, int] = {}
    ) -> str:
        call_schema, defs = _call_alternatives(_chosen(tools, choice))
        schema = _with_defs({**call_schema, "x-guidance": dict(JSON_DEFAULTS)}, defs)
        opening, closing = _lark_text(f"{self.START}\n", added), _lark_text(f"\n{self.END}", added)
        call = f"call: {opening} %json {json.dumps(schema)} {closing}"
        if choice == "required" and parallel:
            return f'start: call ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}\n{call}\n'
        return f"start: call\n{call}\n"

    def _calls(self, body: str) -> list[ToolCall] | None:
        try:
            call = _tool_call(strict_loads(body))
        except (ValueError, RecursionError):  # (not JSON, or nested too deep to read)
            return None
        return None if call is None else [call]

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"{self.START}\n{json.dumps(c, ensure_ascii=False)}\n{self.END}" for c in calls)

    def result_block(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


class NemotronJsonToolParser(_TaggedToolParser):
    """`<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>`: all of a turn's calls as
    one JSON list (NVIDIA's Nemotron-H instruct models; vLLM runs it as the `nemotron_json`
    plugin those models ship)."""

    name = "nemotron_json"
    START = "<TOOLCALL>"
    END = "</TOOLCALL>"
    JSON_BODY = True

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listed = json.dumps(tools, ensure_ascii=False)
        return (
            "You can use the following tools to assist the user if required:\n"
            f"<AVAILABLE_TOOLS>{listed}</AVAILABLE_TOOLS>\n\n"
            "If you decide to call any tool(s), use the following format:\n"
            '<TOOLCALL>[{"name": "tool_name1", "arguments": {"arg1": "value1"}}, '
            '{"name": "tool_name2", "arguments": {"arg2": "value2"}}]</TOOLCALL>'
        )

    def grammar(
        self, tools: list[dict[str, Any]], choice: str, parallel: bool, added: Mapping[str, int] = {}
    ) -> str:
        most = MAX_PARALLEL_CALLS if choice == "required" and parallel else 1
        call_schema, defs = _call_alternatives(_chosen(tools, choice))
        schema = _with_defs(
            {
                "type": "array",
                "items": call_schema,
                "minItems": 1,
                "maxItems": most,
                "x-guidance": dict(JSON_DEFAULTS),
            },
            defs,
        )
        opening, closing = _lark_text(self.START, added), _lark_text(self.END, added)
        return f"start: {opening} %json {json.dumps(schema)} {closing}\n"

    def _calls(self, body: str) -> list[ToolCall] | None:
        try:
            objs = strict_loads(body)
        except (ValueError, RecursionError):  # (not JSON, or nested too deep to read)
            return None
        if isinstance(objs, dict):  # one call written without its list
            objs = [objs]
        if not isinstance(objs, list) or not objs:
            return None
        calls = [_tool_call(o) for o in objs]
        return None if any(c is None for c in calls) else [c for c in calls if c is not None]

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return f"{self.START}{json.dumps(calls, ensure_ascii=False)}{self.END}"

    def result_block(self, content: str) -> str:
        return f"<TOOL_RESPONSE>{content}</TOOL_RESPONSE>"


_INTEGER = r"-?(0|[1-9][0-9]*)"
_NUMBER = _INTEGER + r"(\.[0-9]+)?([eE][+-]?[0-9]+)?"


def _resolved(schema: Any, defs: dict[str, Any] | None) -> Any:
    """A schema that is only a local `$ref` (with a description or a title) as the definition it
    points at among the tool's root `$defs` (`_rooted`); any other schema as it is."""
    if not isinstance(schema, dict):
        return schema
    ref = schema.get("$ref")
    if (
        defs
        and isinstance(ref, str)
        and ref.startswith("#/$defs/")
        and set(schema) <= {"$ref", "description", "title"}
    ):
        target = defs.get(ref[len("#/$defs/") :].replace("~1", "/").replace("~0", "~"))
        if isinstance(target, dict):
            return target
    return schema


def _param_kind(schema: Any, defs: dict[str, Any] | None, depth: int = 0) -> tuple[str, bool]:
    """(how a `qwen3_coder` value of `schema` reads, whether null is allowed), as vLLM types it:
    "string" (text as written: a string, a choice of strings, or a schema with no type at all),
    "integer", "number", "boolean", "null", or "json" (an object, an array, a choice of other
    values, a constant that is not a string). A local `$ref` is followed; a union (a list of types,
    `anyOf`, `oneOf`) is a string when it allows one (Optional[str]), else its first type that
    is not null."""
    schema = _resolved(schema, defs)
    if not isinstance(schema, dict) or depth > 8:
        return "string", False
    kinds: list[str] = []
    nullable = False
    kind = schema.get("type")
    if isinstance(kind, str | list):
        kinds = [k for k in (kind if isinstance(kind, list) else [kind]) if isinstance(k, str)]
    else:
        for key in ("anyOf", "oneOf"):
            subs = schema.get(key)
            for sub in subs if isinstance(subs, list) else []:
                sub_kind, sub_null = _param_kind(sub, defs, depth + 1)
                kinds.append(sub_kind)
                nullable |= sub_null
    nullable |= "null" in kinds
    if not kinds:
        enum = schema.get("enum")
        if isinstance(enum, list) and enum:
            return ("string" if all(isinstance(v, str) for v in enum) else "json"), nullable
        if "const" in schema:
            return ("string" if isinstance(schema["const"], str) else "json"), schema["const"] is None
        return ("json" if "properties" in schema or "items" in schema else "string"), nullable
    if "string" in kinds:
        return "string", nullable
    first = next((k for k in kinds if k != "null"), "null")
    return (first if first in ("integer", "number", "boolean", "null") else "json"), nullable


def _typed_value(raw: str, schema: Any, defs: dict[str, Any] | None = None) -> Any:
    """A `qwen3_coder` parameter's text as the value its schema says (vLLM's typing,
    `_param_kind`): text as written for a string; an integer or number when the text is one in
    JSON's form, a boolean for true or false in any case (else the text); null for "null" unless
    the schema allows only strings; objects and arrays as JSON when it parses (strictly: no NaN,
    no number JSON cannot write back), else the text. A parameter the tool does not declare
    (`schema` None) stays text. Never raises: a value that does not read stays text."""
    if schema is None:
        return raw
    kind, nullable = _param_kind(schema, defs)
    if raw.strip() == "null" and (nullable or kind != "string"):
        return None
    if kind in ("string", "null"):
        return raw
    text = raw.strip()
    if kind in ("integer", "number") and re.fullmatch(_INTEGER, text):
        try:
            return int(text)
        except ValueError:  # (more digits than Python converts)
            return raw
    if kind == "number" and re.fullmatch(_NUMBER, text):
        v = float(text)
        return v if math.isfinite(v) else raw  # (1e400: no JSON number holds it)
    if kind in ("integer", "number"):
        return raw
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower(), raw)  # (True / False too, as vLLM)
    try:
        return strict_loads(text)
    except (ValueError, RecursionError):
        return raw


# a qwen3_coder text value with the newline that ends it (Qwen3CoderToolParser.grammar): no "</"
# anywhere (no closing tag inside it), and no line after the first starting with "<"
_TEXT_VALUE = r"/([^<\n]|<+[^<\/\n]|<*\n+[^<\n])*<*\n/"
# The longest maxLength a text value's grammar keeps: its terminal's states grow with the bound (a
# grammar with 10,000 compiles in about 0.1 s, with 50,000 in 0.7 s); a longer bound is left out.
MAX_TEXT_LENGTH_BOUND = 10_000


def _text_value(schema: Any, name: str) -> tuple[str, list[str]]:
    """(the grammar of a qwen3_coder text value with its ending newline, the terminal it needs).
    With minLength / maxLength (up to MAX_TEXT_LENGTH_BOUND) the text is also that many
    characters and does not begin with a newline (the parser drops one there, which would make
    it a character shorter than it was counted): the intersection of terminals, llguidance's `&`."""
    lo = schema.get("minLength") if isinstance(schema, dict) else None
    hi = schema.get("maxLength") if isinstance(schema, dict) else None
    lo = lo if isinstance(lo, int) and not isinstance(lo, bool) and lo > 0 else 0
    hi = hi if isinstance(hi, int) and not isinstance(hi, bool) and 0 <= hi <= MAX_TEXT_LENGTH_BOUND else None
    if lo == 0 and hi is None or (hi is not None and lo > hi) or lo > MAX_TEXT_LENGTH_BOUND:
        return _TEXT_VALUE, []
    # (the ending newline is one more character)
    count = f"{{{lo + 1},{'' if hi is None else hi + 1}}}"
    return name, [f"{name}: {_TEXT_VALUE} & /(.|\\n){count}/ & /[^\\n](.|\\n)*|\\n/"]


# a parameter name the parser reads back as written (`_PARAMETER`, stripped)
_PARAM_NAME = re.compile(r"[^>\s](?:[^>\n]*[^>\s])?")
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


class Qwen3CoderToolParser(_TaggedToolParser):
    """`<tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue\\n</parameter>\\n...</function>\\n</tool_call>`
    (Qwen3-Coder; NVIDIA's Nemotron 3 models, which vLLM serves with its parser of this name): a
    block per call, each parameter's value as text between newlines, typed by the tool's schema
    (`_typed_value`)."""

    name = "qwen3_coder"
    START = "<tool_call>"
    END = "</tool_call>"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        # a tool's name -> (its parameters' schemas, the definitions their refs point at)
        self._params: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
        for t in tools or []:
            params, defs = _rooted_parameters(t["function"].get("parameters") or {})
            props = params.get("properties")
            self._params[t["function"]["name"]] = (props if isinstance(props, dict) else {}, defs)

    def for_tools(self, tools: list[dict[str, Any]]) -> Self:
        return type(self)(tools)

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            "# Tools\n\nYou have access to the following functions:\n\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "If you choose to call a function, reply in the following format, one block per call:\n"
            "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
            "</parameter>\n</function>\n</tool_call>"
        )

    def grammar(
        self, tools: list[dict[str, Any]], choice: str, parallel: bool, added: Mapping[str, int] = {}
    ) -> str:
        """Each call's parameters in the order its schema lists them, the required ones always
        and the others at most once. A string value is text without "</" whose lines after the
        first do not start with "<" (so that it ends where its closing tag begins: the lexer takes
        the longest text and cannot step back), its minLength and maxLength kept (`_text_value`),
        while a JSON value (an object, an array) follows its whole schema. A parameter name the
        format cannot carry is a ToolError."""
        rules: list[str] = []
        calls = []
        text_end, value_end = _lark_text("</parameter>\n", added), _lark_text("\n</parameter>\n", added)
        for i, t in enumerate(_chosen(tools, choice)):
            fn = t["function"]
            params, defs = _rooted_parameters(fn.get("parameters") or {})
            raw_props = params.get("properties")
            props: dict[str, Any] = raw_props if isinstance(raw_props, dict) else {}
            raw_required = params.get("required")
            required = (
                {r for r in raw_required if isinstance(r, str)} if isinstance(raw_required, list) else set()
            )
            parts = []
            for j, (pname, pschema) in enumerate(props.items()):
                if not _PARAM_NAME.fullmatch(pname):
                    raise ToolError(
                        "tool_choice",
                        f"{fn['name']}: the parameter name {pname!r} cannot be written in the "
                        "qwen3_coder format (no '>', no newline, no space at its ends)",
                    )
                rule, opening = f"p{i}_{j}", _lark_text(f"<parameter={pname}>\n", added)
                value = _value_grammar(pschema, defs)
                if value is None:  # text: lines, none of the later ones starting with "<"
                    text, terminal = _text_value(pschema, rule.upper())
                    rules += terminal
                    rules.append(f"{rule}: {opening} {text} {text_end}")
                else:
                    rules.append(f"{rule}: {opening} {value} {value_end}")
                parts.append(rule if pname in required else f"{rule}?")
            head = _lark_text(f"{self.START}\n<function={fn['name']}>\n", added)
            tail = _lark_text(f"</function>\n{self.END}", added)
            rules.append(f"c{i}: {head} {' '.join(parts)} {tail}")
            calls.append(f"c{i}")
        start = (
            f'start: call ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}'
            if choice == "required" and parallel
            else "start: call"
        )
        return "\n".join([start, f"call: {' | '.join(calls)}", *rules]) + "\n"

    def _calls(self, body: str) -> list[ToolCall] | None:
        m = _FUNCTION.search(body)
        if m is None or body[: m.start()].strip() or body[m.end() :].strip():
            return None
        name = m.group(1).strip()
        schemas, defs = self._params.get(name, ({}, {}))
        args: dict[str, Any] = {}
        for pm in _PARAMETER.finditer(m.group(2)):
            value = pm.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            pname = pm.group(1).strip()
            args[pname] = _typed_value(value, schemas.get(pname), defs)
        return [ToolCall(name=name, arguments=arguments_json(args))]

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        blocks = []
        for c in calls:
            raw_args = c.get("arguments")
            args: dict[str, Any] = raw_args if isinstance(raw_args, dict) else {}
            params = "".join(
                f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
                for k, v in args.items()
            )
            blocks.append(f"{self.START}\n<function={c.get('name')}>\n{params}</function>\n{self.END}")
        return "\n".join(blocks)

    def result_block(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


def _rooted_parameters(params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A `qwen3_coder` tool's parameters schema with its definitions at the root (`_rooted`; each
    JSON value's schema refers to them), a root that is only a `$ref` (a pydantic model)
    followed: (the schema whose `properties` are the parameters, the definitions)."""
    params = prepared_schema(params)
    _, defs = _rooted(params, "tool")
    if defs:
        params = defs["tool"]
        target = _resolved(params, defs)
        params = target if isinstance(target, dict) else params
    return params, defs


def _value_grammar(schema: Any, defs: dict[str, Any] | None = None) -> str | None:
    """The grammar of a `qwen3_coder` parameter's value, as `_typed_value` reads it back: None for
    text (a string, or no type), the literal forms of integers, numbers and booleans (a schema of
    one number type by JSON's grammar, its bounds kept), the choices of a string enum, and JSON
    by the schema for anything else (with `defs`, the tool's
    definitions its refs point at, `_rooted`)."""
    target = _resolved(schema, defs)
    target = target if isinstance(target, dict) else {}
    enum = target.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) and "\n" not in v for v in enum):
        return "(" + " | ".join(json.dumps(v) for v in enum) + ")"
    kind, _ = _param_kind(schema, defs)
    if kind == "string":
        return None
    if kind in ("integer", "number") and target.get("type") != kind:
        # (a number among other types: the bare literal forms `_typed_value` reads)
        return f"/{_INTEGER if kind == 'integer' else _NUMBER}/"
    if kind == "boolean":
        return '("true" | "false")'
    if kind == "null":
        return '"null"'
    # JSON by the schema: objects, arrays, and a schema of one number type, whose JSON grammar
    # writes the same literal forms and keeps its minimum, maximum, multipleOf and choices (the
    # bare forms would not: a forced call could write 999 for an hour)
    return f"%json {json.dumps(_with_defs({**target, 'x-guidance': dict(JSON_DEFAULTS)}, defs or {}))}"


class FirstCallOnly:
    """A parser's format with at most one call read from an output (`parallel_tool_calls`: false,
    as OpenAI means it, for "auto" too, where no grammar holds the model to one): the first call
    is kept and later ones are dropped, neither calls nor content. Streamed and not alike, since
    both read the output through `scan`."""

    def __init__(self, inner: ToolParser) -> None:
        self.inner = inner
        self.name = inner.name

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        return self.inner.system_prompt(tools)

    def grammar(
        self, tools: list[dict[str, Any]], choice: str, parallel: bool, added: Mapping[str, int] = {}
    ) -> str:
        return self.inner.grammar(tools, choice, False, added)

    def scan(self, text: str, final: bool) -> tuple[list[str | ToolCall], int]:
        items, end = self.inner.scan(text, final)
        calls = [i for i, x in enumerate(items) if isinstance(x, ToolCall)]
        return [x for i, x in enumerate(items) if i not in calls[1:]], end

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return self.inner.render_calls(calls)

    def result_block(self, content: str) -> str:
        return self.inner.result_block(content)

    def for_tools(self, tools: list[dict[str, Any]]) -> ToolParser:
        return FirstCallOnly(self.inner.for_tools(tools))


TOOL_PARSERS: dict[str, ToolParser] = {
    p.name: p for p in (HermesToolParser(), NemotronJsonToolParser(), Qwen3CoderToolParser())
}


def split_message(parser: ToolParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a complete output: content is the text outside valid calls (None when
    it is only whitespace), as OpenAI's message has it."""
    items, _ = parser.scan(text, final=True)
    content = "".join(x for x in items if isinstance(x, str))
    calls = [x for x in items if isinstance(x, ToolCall)]
    return (content if content.strip() else None), calls


class ToolCallStream:
    """Content and calls of a streamed output as they become settled (see the module docstring).
    What it hands out adds up to `split_message` of the whole text."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        # Only the text past the settled prefix is scanned again: the settled part reads the same
        # whatever follows it (`scan`), and scanning the whole output at every delta cost time
        # quadratic in its length (a 200 KB answer: ~2 s of the server's event loop).
        self.unsettled = ""
        self.held = ""  # settled content that is only whitespace so far (it may stay None)
        self.any_content = False
        self.calls: list[ToolCall] = []

    def feed(self, delta: str, final: bool) -> tuple[str, list[ToolCall]]:
        """New content and newly completed calls after `delta` (the last with `final`)."""
        self.unsettled += delta
        items, end = self.parser.scan(self.unsettled, final)
        self.unsettled = self.unsettled[end:]
        content = self.held + "".join(x for x in items if isinstance(x, str))
        new_calls = [x for x in items if isinstance(x, ToolCall)]
        if self.calls and isinstance(self.parser, FirstCallOnly):
            new_calls = []  # (its first call was in an earlier piece: later ones are dropped)
        self.calls.extend(new_calls)
        if not self.any_content and not content.strip():
            self.held = content
            return "", new_calls
        self.any_content, self.held = True, ""
        return content, new_calls


def tool_call_deltas(calls: list[ToolCall], first_index: int) -> list[list[dict[str, Any]]]:
    """Streamed `delta.tool_calls` lists for new calls, as OpenAI sends them: per call, one with
    its index, id, type and name (empty arguments), then one with its arguments."""
    out: list[list[dict[str, Any]]] = []
    for k, c in enumerate(calls):
        idx = first_index + k
        out.append(
            [{"index": idx, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}]
        )
        out.append([{"index": idx, "function": {"arguments": c.arguments}}])
    return out


def with_tools_in_system_prompt(
    messages: list[dict[str, Any]], parser: ToolParser, tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The messages with the tools described in the system message (a new first message if there
    is none), for templates that do not render tools themselves."""
    text = parser.system_prompt(tools)
    out = [dict(m) for m in messages]
    if out and out[0].get("role") in ("system", "developer"):
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{text}".lstrip("\n")
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def render_tool_calls(parser: ToolParser, calls: list[dict[str, Any]]) -> str:
    """An assistant message's `tool_calls` as the text the model would have written (for templates
    that do not render them)."""
    objs = []
    for c in calls:
        fn = c.get("function", {})
        args = fn.get("arguments", "{}")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            parsed = args
        objs.append({"name": fn.get("name"), "arguments": parsed})
    return parser.render_calls(objs)


def with_tool_history_as_text(
    messages: list[dict[str, Any]], parser: ToolParser, *, calls: bool, results: bool
) -> list[dict[str, Any]]:
    """The messages with an agent's tool history as text, for templates that do not render it.
    `calls`: an assistant's `tool_calls` are appended to its content as the blocks the model
    writes (`render_tool_calls`). `results`: the `tool` messages become a user turn of the
    parser's result blocks (consecutive results share one turn; Hermes and Qwen templates write
    `<tool_response>...</tool_response>`): a ChatML model knows no "tool" role, and the user turn
    is where such models see results."""
    if not (calls or results):
        return messages
    out: list[dict[str, Any]] = []
    merged: set[int] = set()  # indexes in `out` of user turns made of tool results
    for m in messages:
        if calls and m.get("tool_calls"):
            blocks = render_tool_calls(parser, m["tool_calls"])
            content = m.get("content") or ""
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = f"{content}\n{blocks}" if content else blocks
        elif results and m.get("role") == "tool":
            block = parser.result_block(m.get("content") or "")
            if len(out) - 1 in merged:
                out[-1]["content"] += f"\n{block}"
                continue
            merged.add(len(out))
            m = {"role": "user", "content": block}
        out.append(m)
    return out
