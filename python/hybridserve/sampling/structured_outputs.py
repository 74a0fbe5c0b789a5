"""Structured outputs: what a request's output must match, and the grammar that says it.

`StructuredOutputsParams` is vLLM's request field of the same name: exactly one of `json` (a JSON
schema), `regex`, `choice` (one of a list of strings), `grammar` (a Lark grammar in llguidance's
dialect, or a GBNF grammar) or `json_object` (any JSON object). `SamplingParams.structured_outputs`
carries it; the engine compiles it (engine/grammar_compiler.py) and masks every token the grammar
does not allow (sampling/grammar.py). docs/structured-outputs.md has the design.

The grammar library is llguidance; this module only builds its grammar text (`to_grammar`) and
checks the request's own shape (types, sizes). Whether a schema, regex or grammar is valid is
known only when it is compiled, and a compile error is an InvalidRequestError then.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from hybridserve.errors import InvalidRequestError

# The largest grammar source accepted (characters of the schema as JSON, of the regex, grammar or
# choices). Compilation runs on threads with a large stack (engine/grammar_compiler.py) because
# llguidance recurses along chains of rules; this bounds how deep such a chain can be.
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_CHOICES = 1024
MAX_START_AFTER_CHARS = 256

# How JSON is laid out under a schema: Python's `json.dumps` separators and no other whitespace.
# Free whitespace would let a model write spaces and newlines forever without breaking the
# grammar; with fixed separators a schema whose strings, numbers and arrays are bounded has a
# longest valid output, so a request with enough max_tokens always ends in valid JSON. A schema
# may override these with llguidance's "x-guidance" key.
JSON_DEFAULTS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}

# `disable_any_whitespace` (vLLM's): JSON without a space between its items and after its keys
COMPACT_SEPARATORS = {"item_separator": ",", "key_separator": ":"}

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's options beside the kind, which this engine serves
OPTIONS = ("disable_any_whitespace", "disable_additional_properties")

# The string formats llguidance checks; JSON Schema makes `format` an annotation, so another one
# (pydantic's "path", "password", "binary"; OpenAPI's "uri-reference", "byte") leaves the string
# free rather than refusing the schema
FORMATS = frozenset(
    ("date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri")
)
# Keywords whose value is a map of names to schemas, one schema, or a list of schemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = (
    "items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
    "unevaluatedProperties", "unevaluatedItems", "additionalItems",
)  # fmt: skip
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
# a GBNF rule (`name ::= ...`): anything else is Lark (`start:`, `?start:`, `%llguidance`)
_GBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w-]*\s*::=", re.M)


def _check_regex(regex: str, what: str) -> None:
    """ValueError for a regex that ends in a lone backslash (an escape of nothing): invalid in
    every dialect, but llguidance takes it without a word and changes its meaning
    (`regex_to_lark` drops the backslash, so `[0-9]+\\` became `[0-9]+`; a schema's `pattern`
    ending in one no longer constrained the string), so outputs ended "stop" matching a regex
    the client never wrote."""
    if (len(regex) - len(regex.rstrip("\\"))) % 2:
        raise ValueError(f"{what} {regex!r} ends in a lone backslash (escape it as \\\\)")


# A number's bounds: llguidance reads them as f64, so an integer bound past 2**53 was rounded to
# the nearest double, either way, and the output could be out of range: {"minimum": 2**53 + 1,
# "maximum": 2**53 + 1} gave 2**53, which ended "stop"
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_CONTAINS_COUNTS = ("minContains", "maxContains")  # (bound nothing without `contains`)
_LOWER_BOUNDS = ("minimum", "exclusiveMinimum")
_UPPER_BOUNDS = ("maximum", "exclusiveMaximum")


def _inward_bound(value: int, lower: bool) -> int | float:
    """An integer bound as the nearest double on its range's side, so that every number the
    grammar allows is within the bound (a range with no double left in it is then refused as
    unsatisfiable); the bound itself where it is exact, or too large to be a double."""
    try:
        f = float(value)
    except OverflowError:
        return value
    if lower and f < value:
        f = math.nextafter(f, math.inf)
    elif not lower and f > value:
        f = math.nextafter(f, -math.inf)
    return value if f == value else f


def _check_exact_data(value: Any, key: str, depth: int = 0) -> None:
    """`const` / `enum` data the grammar writes as given: llguidance reads its numbers as doubles,
    so an integer no double holds (past 2**53) would be written as a neighbour of it (`const`
    9007199254740993 gave 9007199254740992, ending "stop"). ValueError naming it."""
    if isinstance(value, bool) or depth > 200:
        return
    if isinstance(value, int):
        try:
            exact = float(value) == value
        except OverflowError:
            exact = False
        if not exact:
            raise ValueError(
                f"{key}: the integer {value} has no exact double (past 2**53), and the grammar's numbers "
                "are doubles; give it as a string"
            )
    elif isinstance(value, list):
        for v in value:
            _check_exact_data(v, key, depth + 1)
    elif isinstance(value, dict):
        for v in value.values():
            _check_exact_data(v, key, depth + 1)


def _side_of_64_bits(key: str, bound: int | float) -> str | None:
    """Where an integer schema's bound lies against the 64-bit integers: "far" when it excludes
    none of them (a lower bound at or below the least), "near" when it excludes all of them, None
    when it falls within (an exclusive bound at an end of the range still excludes that end)."""
    exclusive = key.startswith("exclusive")
    if key in _LOWER_BOUNDS:
        if bound < _I64_MIN or (bound == _I64_MIN and not exclusive):
            return "far"
        return "near" if bound > _I64_MAX or (bound == _I64_MAX and exclusive) else None
    if bound > _I64_MAX or (bound == _I64_MAX and not exclusive):
        return "far"
    return "near" if bound < _I64_MIN or (bound == _I64_MIN and exclusive) else None


_GBNF_ESCAPE = re.compile(r"\\(\\|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8})")
# characters a GBNF string or class gives meaning to, and controls: written as \xNN
_GBNF_SPECIAL = set('"\\[]-^') | {chr(c) for c in range(0x20)} | {"\x7f"}


def _gbnf_unicode_escapes(grammar: str) -> str:
    r"""GBNF's `\u` (four hex digits) and `\U` (eight) escapes as the characters they stand for
    (`\xNN` for one the grammar gives meaning to). llguidance's converter drops their leading
    zeros, which turned `"\u004100"` ("A00") into "\u4100" (a CJK character) and refused `"\u00e9"`."""

    def char(m: re.Match[str]) -> str:
        if m.group(1) == "\\":
            return m.group(0)  # (an escaped backslash: what follows is text)
        code = int(m.group(1)[1:], 16)
        if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
            return m.group(0)  # (no character: left for the converter to refuse)
        c = chr(code)
        return f"\\x{code:02x}" if c in _GBNF_SPECIAL else c

    return _GBNF_ESCAPE.sub(char, grammar)


def prepared_schema(schema: Any, *, closed_objects: bool = False, depth: int = 0) -> Any:
    """A JSON schema as the grammar is built from it: `format`s llguidance does not check left out
    (an annotation to JSON Schema, not a reason to refuse the schema), and with `closed_objects`
    (OpenAI's `strict`, vLLM's `disable_additional_properties`) every object schema that does not
    say otherwise takes no properties beyond its own. Returns a new schema; data (`const`,
    `enum`, `default`, `examples`) is left as it is; the exclusive integer bounds of a schema
    whose numbers are integers (its types take integer and not number) become inclusive ones,
    and an integer bound that is no double is rounded into its range (`_inward_bound`).
    ValueError for a `pattern` (or a `patternProperties` name) that ends in a lone backslash
    (`_check_regex`), and for `const` /
    `enum` data holding an integer no double holds (`_check_exact_data`)."""
    if not isinstance(schema, dict) or depth > 200:  # (deeper is refused when compiled)
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "format" and isinstance(value, str) and value not in FORMATS:
            continue
        # keywords that constrain nothing here, which the library refuses as unimplemented
        if (key == "uniqueItems" and value is False) or (
            key in _CONTAINS_COUNTS and "contains" not in schema
        ):
            continue
        if key == "pattern" and isinstance(value, str):
            _check_regex(value, "pattern")
        if key in ("const", "enum"):
            _check_exact_data(value, key)
        if key == "patternProperties" and isinstance(value, dict):
            for regex in value:
                _check_regex(regex, "patternProperties")
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {
                k: prepared_schema(v, closed_objects=closed_objects, depth=depth + 1)
                for k, v in value.items()
            }
        elif key in _SCHEMA_ONE:
            value = prepared_schema(value, closed_objects=closed_objects, depth=depth + 1)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            value = [prepared_schema(v, closed_objects=closed_objects, depth=depth + 1) for v in value]
        out[key] = value
    kind = out.get("type")
    # (integers and no other numbers: ["integer", "null"] too)
    integers_only = kind == "integer" or (
        isinstance(kind, list) and "integer" in kind and "number" not in kind
    )
    if integers_only:
        # an exclusive bound as the inclusive one (the library adds 1 to it in doubles, which past
        # 2**53 adds nothing: exclusiveMinimum 2**53 allowed 2**53)
        for exclusive, inclusive, step in (
            ("exclusiveMinimum", "minimum", 1),
            ("exclusiveMaximum", "maximum", -1),
        ):
            bound = out.get(exclusive)
            if type(bound) is int:
                del out[exclusive]
                given = out.get(inclusive)
                if not isinstance(given, int | float) or (given - bound - step) * step < 0:
                    out[inclusive] = bound + step
    if integers_only:
        # the grammar's integers are 64-bit, and it saturates a bound past them: minimum 1e20
        # allowed 2**63 - 1. A bound on the far side of that range bounds nothing; one on the
        # near side leaves no integer.
        for key in _LOWER_BOUNDS + _UPPER_BOUNDS:
            bound = out.get(key)
            if isinstance(bound, bool) or not isinstance(bound, int | float):
                continue
            side = _side_of_64_bits(key, bound)
            if side == "far":
                del out[key]
            elif side == "near":
                raise ValueError(
                    f"{key}: {bound!r} leaves no 64-bit integer, and the grammar's integers are 64-bit"
                )
    for key in _LOWER_BOUNDS + _UPPER_BOUNDS:
        if type(out.get(key)) is int:
            out[key] = _inward_bound(out[key], key in _LOWER_BOUNDS)
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in out
    if closed_objects and is_object and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _bad(msg: str) -> InvalidRequestError:
    return InvalidRequestError(f"structured_outputs: {msg}")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of the fields is given (not None); `json_object` must then be True."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # The request field that carried it ("response_format", "tool_choice", ...): how errors name it
    param: str = field(default="structured_outputs", compare=False)
    # The grammar applies only after the output has held this text's tokens (a thinking model's
    # `</think>`: its reasoning is free, its answer matches the grammar); None: from the start
    start_after: str | None = None
    # vLLM's options: JSON without whitespace between items and after keys; object schemas that
    # do not say otherwise take no other properties (also what OpenAI's `strict` means)
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        """Which field is set: "json", "regex", "choice", "grammar" or "json_object"."""
        for name in _KINDS:
            if getattr(self, name) is not None:
                return name
        raise _bad("one of json, regex, choice, grammar or json_object is required")

    def validate(self) -> None:
        """The request's own shape (InvalidRequestError naming the field); not the grammar's
        validity, which compiling it decides."""
        given = [n for n in _KINDS if getattr(self, n) is not None]
        if len(given) != 1:
            what = "none" if not given else ", ".join(given)
            raise _bad(
                f"exactly one of json, regex, choice, grammar or json_object must be given, got {what}"
            )
        kind = given[0]
        if kind == "json":
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except (ValueError, RecursionError) as e:  # RecursionError: nested too deeply
                    raise _bad(f"json: not valid JSON ({e})") from None
            else:
                schema = self.json
            if not isinstance(schema, dict):
                raise _bad(f"json: a JSON schema is an object, got {type(schema).__name__}")
        elif kind in ("regex", "grammar"):
            v = getattr(self, kind)
            if not isinstance(v, str) or not v:
                raise _bad(f"{kind}: must be a non-empty string")
        elif kind == "choice":
            c = self.choice
            if not isinstance(c, list | tuple) or not c or not all(isinstance(s, str) and s for s in c):
                raise _bad("choice: must be a non-empty list of non-empty strings")
            if len(c) > MAX_CHOICES:
                raise _bad(f"choice: at most {MAX_CHOICES} choices")
        elif self.json_object is not True:
            raise _bad("json_object: must be true")
        for option in OPTIONS:
            if not isinstance(getattr(self, option), bool):
                raise _bad(f"{option}: must be true or false, got {getattr(self, option)!r}")
        if self.start_after is not None and (
            not isinstance(self.start_after, str) or not 0 < len(self.start_after) <= MAX_START_AFTER_CHARS
        ):
            raise _bad(f"start_after: a non-empty string of at most {MAX_START_AFTER_CHARS} characters")
        try:
            size = len(self.source)
        except (TypeError, ValueError, RecursionError) as e:  # a set, bytes, a cycle, a deep nest
            raise _bad(f"{kind}: the schema must be a JSON value ({e})") from None
        if size > MAX_GRAMMAR_CHARS:
            raise _bad(f"{kind}: at most {MAX_GRAMMAR_CHARS} characters, got {size}")

    @property
    def source(self) -> str:
        """The grammar source as one string (what the size limit counts and the cache keys on)."""
        kind = self.kind
        if kind == "json":
            return self.json if isinstance(self.json, str) else json.dumps(self.json, ensure_ascii=False)
        if kind == "choice":
            return json.dumps(list(self.choice or []), ensure_ascii=False)
        if kind == "json_object":
            return ""
        v = getattr(self, kind)
        assert isinstance(v, str)
        return v

    @property
    def cache_key(self) -> tuple[str, str]:
        """Requests with equal keys share one compiled grammar."""
        options = "".join("1" if getattr(self, o) else "0" for o in OPTIONS)
        return f"{self.kind}/{options}", self.source

    def to_grammar(self) -> str:
        """The llguidance grammar (its JSON form). Raises InvalidRequestError when the source
        cannot even be converted (a GBNF grammar that does not parse); other errors show when the
        grammar is compiled."""
        import llguidance

        kind = self.kind
        matcher = llguidance.LLMatcher
        defaults = {**JSON_DEFAULTS, **(COMPACT_SEPARATORS if self.disable_any_whitespace else {})}
        try:
            if kind == "json":
                schema: Any = json.loads(self.json) if isinstance(self.json, str) else self.json
                schema = prepared_schema(schema, closed_objects=self.disable_additional_properties)
                return matcher.grammar_from_json_schema(schema, defaults=defaults)  # type: ignore[arg-type]
            if kind == "json_object":
                return matcher.grammar_from_json_schema({"type": "object"}, defaults=defaults)  # type: ignore[arg-type]
            if kind == "regex":
                _check_regex(self.regex or "", "the regex")
                # (\d, \w and \s as ASCII classes, as in a JSON schema's `pattern` and vLLM's
                # backends: Unicode digits are no digits to a zip code)
                return matcher.grammar_from_lark(
                    f"start: /{llguidance.regex_to_lark(self.regex or '', 'dws')}/"
                )
            if kind == "choice":
                alternatives = " | ".join(json.dumps(s) for s in self.choice or [])
                return matcher.grammar_from_lark(f"start: {alternatives}")
            text = self.grammar or ""
            if _GBNF_RULE.search(text):
                from llguidance.gbnf_to_lark import gbnf_to_lark

                try:
                    text = gbnf_to_lark(_gbnf_unicode_escapes(text))
                except Exception as e:  # (the converter's own errors derive from Exception)
                    raise ValueError(f"Failed to convert the grammar from GBNF to Lark: {e}") from None
            return matcher.grammar_from_lark(text)
        except (ValueError, RecursionError) as e:
            raise _bad(f"invalid {kind}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """The one field that is set, and the options that are on, as vLLM's request field
        spells them."""
        return {self.kind: getattr(self, self.kind), **{o: True for o in OPTIONS if getattr(self, o)}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StructuredOutputsParams:
        unknown = sorted(set(d) - set(_KINDS) - set(OPTIONS) - {"param", "start_after"})
        if unknown:
            raise _bad(f"unknown field {unknown[0]!r} (supported: {', '.join((*_KINDS, *OPTIONS))})")
        return cls(**{k: v for k, v in d.items() if v is not None})
