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

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


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
        return self.kind, self.source

    def to_grammar(self) -> str:
        """The llguidance grammar (its JSON form). Raises InvalidRequestError when the source
        cannot even be converted (a GBNF grammar that does not parse); other errors show when the
        grammar is compiled."""
        import llguidance

        kind = self.kind
        matcher = llguidance.LLMatcher
        try:
            if kind == "json":
                schema: Any = json.loads(self.json) if isinstance(self.json, str) else self.json
                return matcher.grammar_from_json_schema(schema, defaults=dict(JSON_DEFAULTS))  # type: ignore[arg-type]
            if kind == "json_object":
                return matcher.grammar_from_json_schema({"type": "object"}, defaults=dict(JSON_DEFAULTS))  # type: ignore[arg-type]
            if kind == "regex":
                return matcher.grammar_from_regex(self.regex or "")
            if kind == "choice":
                alternatives = " | ".join(json.dumps(s) for s in self.choice or [])
                return matcher.grammar_from_lark(f"start: {alternatives}")
            return llguidance.grammar_from("grammar", self.grammar or "")
        except (ValueError, RecursionError) as e:
            raise _bad(f"invalid {kind}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """The one field that is set, as vLLM's request field spells it."""
        return {self.kind: getattr(self, self.kind)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StructuredOutputsParams:
        unknown = sorted(set(d) - set(_KINDS) - {"param", "start_after"})
        if unknown:
            raise _bad(f"unknown field {unknown[0]!r} (supported: {', '.join(_KINDS)})")
        return cls(**{k: v for k, v in d.items() if v is not None})
