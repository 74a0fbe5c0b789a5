"""The request fields that constrain the output with a grammar: OpenAI's `response_format`
(`json_object`, `json_schema`; chat and completions), vLLM's `structured_outputs` (`json`, `regex`,
`choice`, `grammar`, `json_object`) and its older `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar` (which clients written for vLLM before `structured_outputs` still send: ignoring
them would answer unconstrained), and `tool_choice` "required" or a named function (tools.py).
At most one of them may constrain a request. The result is `SamplingParams.structured_outputs`,
labelled with the field it came from, so that an error found when the engine compiles it (an
invalid schema, regex or grammar; one that takes too long) is a 400 naming that field.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from hybridserve.errors import InvalidRequestError
from hybridserve.sampling.structured_outputs import OPTIONS, StructuredOutputsParams
from hybridserve.server.tools import ToolParser

_RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
# vLLM's older fields: each the `structured_outputs` key of the same grammar
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
# ... and its older options of them, which choose nothing here (one grammar library; JSON is
# written without free whitespace): type-checked and ignored
GUIDED_OPTIONS = ("guided_decoding_backend", "guided_whitespace_pattern")
_JSON_SCHEMA_FIELDS = {"name", "description", "schema", "strict"}
# vLLM's fields of `structured_outputs` that would change the output and are not served: refused
# by name rather than left unused (its backend choices and fallbacks change nothing here)
_UNSERVED_OPTIONS = {
    "structural_tag": "a structural tag (tool-call tags around JSON)",
    "whitespace_pattern": "a whitespace pattern (JSON here has fixed separators)",
}


def _refuse(name: str) -> None:
    raise FieldError(name, "unknown field", "unknown_field")


OnUnknown = Callable[[str], None]  # called with a field's path; raises to refuse it, or records it


class FieldError(ValueError):
    """A malformed field: `param` names it, the message starts with it."""

    def __init__(self, param: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.code = code


def _labelled(param: str, **fields: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(param=param, **fields)
    except InvalidRequestError as e:
        raise FieldError(param, str(e).split(": ", 1)[-1]) from None


def parse_response_format(v: Any, on_unknown: OnUnknown = _refuse) -> StructuredOutputsParams | None:
    """OpenAI's `response_format`: {"type": "text"} (no constraint), {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name", "schema", "description"?, "strict"?}}."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise FieldError("response_format", f"must be an object, got {type(v).__name__}", "invalid_type")
    kind = v.get("type")
    if kind not in _RESPONSE_FORMAT_TYPES:
        raise FieldError(
            "response_format.type", f"must be one of {', '.join(_RESPONSE_FORMAT_TYPES)}, got {kind!r}"
        )
    if kind != "json_schema" and v.get("json_schema") is not None:
        raise FieldError("response_format.json_schema", f"only with type 'json_schema', not {kind!r}")
    for key in v:
        if key not in ("type", "json_schema"):
            on_unknown(f"response_format.{key}")
    if kind == "text":
        return None
    if kind == "json_object":
        return _labelled("response_format", json_object=True)
    js = v.get("json_schema")
    if not isinstance(js, dict):
        raise FieldError("response_format.json_schema", "must be an object with the schema", "invalid_type")
    for key in js:
        if key not in _JSON_SCHEMA_FIELDS:
            on_unknown(f"response_format.json_schema.{key}")
    name = js.get("name")
    if name is not None and not isinstance(name, str):
        raise FieldError("response_format.json_schema.name", "must be a string", "invalid_type")
    for key, types in (("description", str), ("strict", bool)):
        if js.get(key) is not None and not isinstance(js[key], types):
            raise FieldError(
                f"response_format.json_schema.{key}", f"must be a {types.__name__}", "invalid_type"
            )
    schema = js.get("schema")
    if schema is None:
        schema = {"type": "object"}
    if not isinstance(schema, dict):
        raise FieldError("response_format.json_schema.schema", "must be a JSON schema object", "invalid_type")
    # OpenAI's `strict`: the output has the schema's properties and no others
    return _labelled("response_format", json=schema, disable_additional_properties=js.get("strict") is True)


def parse_structured_outputs(v: Any, on_unknown: OnUnknown = _refuse) -> StructuredOutputsParams | None:
    """vLLM's `structured_outputs`: {"json": schema or its JSON text} | {"regex": str} |
    {"choice": [str, ...]} | {"grammar": Lark or GBNF} | {"json_object": true}."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise FieldError("structured_outputs", f"must be an object, got {type(v).__name__}", "invalid_type")
    fields = {}
    for key, x in v.items():
        if key in _UNSERVED_OPTIONS:
            raise FieldError(
                f"structured_outputs.{key}",
                f"{_UNSERVED_OPTIONS[key]} is not supported",
                "unsupported_parameter",
            )
        if key not in ("json", "regex", "choice", "grammar", "json_object", *OPTIONS):
            on_unknown(f"structured_outputs.{key}")
        elif x is not None:
            fields[key] = x
    if "json" in fields:
        fields["json"] = _schema("structured_outputs.json", fields["json"])
    return _labelled("structured_outputs", **fields)


def _schema(name: str, v: Any) -> dict[str, Any]:
    """A JSON schema given as an object or as its JSON text (vLLM takes both)."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except (json.JSONDecodeError, RecursionError):
            raise FieldError(name, "must be a JSON schema (an object, or its JSON text)") from None
    if not isinstance(v, dict):
        raise FieldError(name, "must be a JSON schema (an object, or its JSON text)", "invalid_type")
    return v


def parse_guided(body: dict[str, Any]) -> list[StructuredOutputsParams]:
    """vLLM's older `guided_*` fields given (not null), each as its `structured_outputs` grammar;
    `guided_json` may be the schema's JSON text, as vLLM took it."""
    found = []
    for name, key in GUIDED_FIELDS.items():
        v = body.get(name)
        if v is None:
            continue
        if name == "guided_json":
            v = _schema(name, v)
        found.append(_labelled(name, **{key: v}))
    for name in GUIDED_OPTIONS:
        if body.get(name) is not None and not isinstance(body[name], str):
            raise FieldError(name, f"must be a string, got {type(body[name]).__name__}", "invalid_type")
    return found


def constraint(
    body: dict[str, Any],
    *,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: str = "none",
    parallel_tool_calls: bool = True,
    parser: ToolParser | None = None,
    on_unknown: OnUnknown = _refuse,
    added_tokens: Mapping[str, int] = {},
) -> StructuredOutputsParams | None:
    """The one grammar a request's fields ask for, or None. Two fields that both constrain the
    output (say `response_format` json_schema and `tool_choice` "required") are a 400.
    `added_tokens`: the tokenizer's added tokens by their text (ToolParser.grammar)."""
    found: list[StructuredOutputsParams] = []
    rf = parse_response_format(body.get("response_format"), on_unknown)
    if rf is not None:
        found.append(rf)
    so = parse_structured_outputs(body.get("structured_outputs"), on_unknown)
    if so is not None:
        found.append(so)
    found += parse_guided(body)
    if tools and parser is not None and tool_choice not in ("none", "auto"):
        found.append(
            _labelled(
                "tool_choice", grammar=parser.grammar(tools, tool_choice, parallel_tool_calls, added_tokens)
            )
        )
    if len(found) > 1:
        raise FieldError(
            found[1].param,
            f"cannot be combined with {found[0].param}: both constrain the output",
            "invalid_value",
        )
    return found[0] if found else None
