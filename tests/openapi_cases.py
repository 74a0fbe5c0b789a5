"""Values derived from the server's OpenAPI document (python/hybridserve/server/openapi.py).

`Spec.conforms` checks a value against the JSON Schema subset the document uses (type, enum,
const, bounds, lengths, items, properties, anyOf, not, if/else, $ref). `Spec.boundary` lists values
on both sides of every bound, enum and type a schema states; `Spec.valid` and `Spec.invalid` are
hypothesis strategies of values it accepts and refuses. Every value is classified by `conforms`,
never by how it was made, so an "invalid" value is invalid by construction: what the document says
a server must refuse. tests/server/test_openapi.py runs the validator on both sides of every
bound; tests/server/test_server_fuzz.py sends a server thousands of requests built from these.
"""

from __future__ import annotations

import math
import re
from functools import cache
from typing import Any

from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

Schema = dict[str, Any]

# JSON values of every type, a few of each extreme; the seeds of wrong-type and out-of-range values.
ODD_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31,
    2**63,
    2**64 + 1,
    -(2**63) - 1,
    10**30,
    -(10**30),
    10**400,  # no float holds it: float() overflows
    0.5,
    -0.0,
    3.0,  # a float, not an integer, for the server
    1e-300,
    1e308,
    -1e308,
    "",
    "0",
    "1",
    "true",
    "null",
    "NaN",
    "\u0000",
    "x" * 300,
    [],
    [None],
    [0],
    [""],
    [[]],
    {},
    {"": None},
    {"type": "text"},
]

# One of each JSON type, inside lists and objects (where every bound's values would be too many).
NESTED_ODD_VALUES: list[Any] = [None, False, 0, 1.5, "", "x", [], {}]


def json_types(v: Any) -> set[str]:
    """The JSON Schema types of a decoded JSON value. A float is never an integer here: the server
    reads 3.0 as a float and refuses it where an integer is due (the document says so)."""
    if v is None:
        return {"null"}
    if isinstance(v, bool):
        return {"boolean"}
    if isinstance(v, int):
        return {"integer", "number"}
    if isinstance(v, float):
        return {"number"}
    if isinstance(v, str):
        return {"string"}
    if isinstance(v, list):
        return {"array"}
    if isinstance(v, dict):
        return {"object"}
    raise TypeError(f"not a JSON value: {type(v).__name__}")


def json_equal(a: Any, b: Any) -> bool:
    """JSON equality: 1 == 1.0, but false != 0 (Python's == says otherwise)."""
    ta, tb = json_types(a), json_types(b)
    if "number" in ta and "number" in tb:
        return bool(a == b)
    if ta != tb:
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return bool(a == b)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _below(x: float) -> float | int:
    return x - 1 if isinstance(x, int) else math.nextafter(x, -math.inf)


def _above(x: float) -> float | int:
    return x + 1 if isinstance(x, int) else math.nextafter(x, math.inf)


class Spec:
    """One OpenAPI document: its schemas, a checker and value generators for them."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc

    def resolve(self, schema: Schema) -> Schema:
        while "$ref" in schema:
            ref = schema["$ref"]
            assert ref.startswith("#/"), ref
            node: Any = self.doc
            for part in ref[2:].split("/"):
                node = node[part]
            schema = node
        return schema

    def request_schema(self, path: str) -> Schema:
        body = self.doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        return self.resolve(body)

    def post_paths(self) -> list[str]:
        return sorted(p for p, item in self.doc["paths"].items() if "post" in item)

    # -----------------------------------------------------------------------------------------
    # Checking

    def conforms(self, schema: Schema, v: Any) -> bool:
        s = self.resolve(schema)
        if "anyOf" in s and not any(self.conforms(b, v) for b in s["anyOf"]):
            return False
        if "not" in s and self.conforms(s["not"], v):
            return False
        if "enum" in s and not any(json_equal(v, e) for e in s["enum"]):
            return False
        if "const" in s and not json_equal(v, s["const"]):
            return False
        if "type" in s:
            allowed = {s["type"]} if isinstance(s["type"], str) else set(s["type"])
            if not json_types(v) & allowed:
                return False
        if "if" in s:
            branch = s.get("then") if self.conforms(s["if"], v) else s.get("else")
            if branch is not None and not self.conforms(branch, v):
                return False
        if _is_number(v):
            if "minimum" in s and v < s["minimum"]:
                return False
            if "exclusiveMinimum" in s and v <= s["exclusiveMinimum"]:
                return False
            if "maximum" in s and v > s["maximum"]:
                return False
        if isinstance(v, str):
            if len(v) < s.get("minLength", 0) or len(v) > s.get("maxLength", math.inf):
                return False
            if "pattern" in s and not re.search(s["pattern"], v):
                return False
        if isinstance(v, list):
            if len(v) < s.get("minItems", 0) or len(v) > s.get("maxItems", math.inf):
                return False
            if "items" in s and not all(self.conforms(s["items"], x) for x in v):
                return False
        if isinstance(v, dict):
            props = s.get("properties", {})
            if any(k not in v for k in s.get("required", [])):
                return False
            if s.get("additionalProperties") is False and any(k not in props for k in v):
                return False
            if not all(self.conforms(props[k], x) for k, x in v.items() if k in props):
                return False
            if len(v) > s.get("maxProperties", math.inf):
                return False
            if "propertyNames" in s and not all(self.conforms(s["propertyNames"], k) for k in v):
                return False
            extra = s.get("additionalProperties")
            if isinstance(extra, dict) and not all(
                self.conforms(extra, x) for k, x in v.items() if k not in props
            ):
                return False
        return True

    # -----------------------------------------------------------------------------------------
    # Examples and boundaries

    def example(self, schema: Schema) -> Any:
        """One small value the schema accepts (the first of `boundary`'s accepted ones)."""
        for v in self.boundary(schema):
            if self.conforms(schema, v):
                return v
        raise AssertionError(f"no example of {schema}")

    def boundary(self, schema: Schema, depth: int = 0) -> list[Any]:
        """Values on both sides of each bound, enum and type the schema states (and the odd
        values): classify them with `conforms`."""
        s = self.resolve(schema)
        out: list[Any] = []
        for b in s.get("anyOf", []):
            out += self.boundary(b, depth)
        out += list(s.get("enum", []))
        if "const" in s:
            out.append(s["const"])
        types = s.get("type", [])
        types = [types] if isinstance(types, str) else list(types)
        for key in ("minimum", "maximum", "exclusiveMinimum"):
            if key in s:
                x = s[key]
                out += [x, _below(x), _above(x)]
                if "integer" in types:
                    out.append(float(x) + 0.5)  # in range but not an integer
        if "string" in types:
            lo, hi = s.get("minLength", 0), s.get("maxLength")
            out += ["a" * lo, "a" * max(lo, 1)]
            if lo > 0:
                out.append("a" * (lo - 1))
            if hi is not None:
                out += ["a" * hi, "é" * hi, "a" * (hi + 1), "😀" * (hi + 1)]
        if "boolean" in types:
            out += [True, False]
        if "integer" in types or "number" in types:
            out += [1, 0]
        if "null" in types:
            out.append(None)
        if depth < 3 and ("array" in types or "items" in s):
            out += self._array_boundary(s, depth)
        if depth < 3 and ("object" in types or "properties" in s):
            out += self._object_boundary(s, depth)
        out += ODD_VALUES if depth == 0 else NESTED_ODD_VALUES
        return _dedup(out)

    def _array_boundary(self, s: Schema, depth: int) -> list[Any]:
        items = s.get("items", {})
        inner = self.boundary(items, depth + 1)
        good = [v for v in inner if self.conforms(items, v)]
        bad = [v for v in inner if not self.conforms(items, v)]
        one = good[0] if good else None
        lo, hi = s.get("minItems", 0), s.get("maxItems")
        out: list[Any] = [[one] * lo]
        if lo > 0:
            out.append([one] * (lo - 1))
        if hi is not None:
            out += [[one] * hi, [one] * (hi + 1)]
        out += [[v] for v in good]
        out += [[v] for v in bad]
        out += [[one, v] for v in bad[:4]]
        return out

    def _key_candidates(self, s: Schema) -> list[str]:
        """Property names to probe a map (`propertyNames`, `additionalProperties` a schema) with:
        the ones its `propertyNames` accepts first."""
        odd = ["0", "1", "7", "00", "01", "-1", "+1", "1.5", "1e2", " 1", "a", "", "\u0661"]
        odd += [str(10**k + d) for k in range(1, 6) for d in (-1, 0, 1)]
        names = s.get("propertyNames", {})
        return sorted(odd, key=lambda k: not self.conforms(names, k))

    def _map_boundary(self, s: Schema, depth: int) -> list[Any]:
        keys = self._key_candidates(s)
        names = s.get("propertyNames", {})
        good_key = keys[0]
        extra = s.get("additionalProperties")
        values = self.boundary(extra, depth + 1)[:24] if isinstance(extra, dict) else [0]
        good_v = next((v for v in values if not isinstance(extra, dict) or self.conforms(extra, v)), 0)
        out: list[Any] = [{k: good_v} for k in keys]
        out += [{good_key: v} for v in values]
        valid_keys = [k for k in keys if self.conforms(names, k)]
        out.append({k: good_v for k in valid_keys})
        if "maxProperties" in s:
            hi = s["maxProperties"]
            out += [{str(i): good_v for i in range(n)} for n in (hi, hi + 1)]
        return out

    def _object_boundary(self, s: Schema, depth: int) -> list[Any]:
        props: dict[str, Schema] = s.get("properties", {})
        required = s.get("required", [])
        base = {k: self.example(props[k]) for k in required}
        out: list[Any] = [dict(base), {**base, "unknown_field": 1}]
        if "propertyNames" in s or isinstance(s.get("additionalProperties"), dict):
            out += self._map_boundary(s, depth)
        for k in required:
            out.append({n: v for n, v in base.items() if n != k})
        for name, p in props.items():
            for v in self.boundary(p, depth + 1)[:24]:
                out.append({**base, name: v})
        return out

    # -----------------------------------------------------------------------------------------
    # Strategies

    def valid(self, schema: Schema) -> SearchStrategy[Any]:
        """Values the schema accepts (kept small: strings of at most 12 characters, lists of at
        most 3 items beyond their minimum)."""
        return _valid(self, _key(schema))

    def invalid(self, schema: Schema) -> SearchStrategy[Any]:
        """Values the schema refuses: boundary values, odd values of every type, random JSON,
        and (inside lists and objects) one part made invalid."""
        return _invalid(self, _key(schema))


def _dedup(values: list[Any]) -> list[Any]:
    seen: set[str] = set()
    out = []
    for v in values:
        k = repr(v) + str(sorted(json_types(v)))
        if k not in seen:
            seen.add(k)
            out.append(v)
    return out


# Schemas are dicts (unhashable): strategies are cached by the schema's repr within one Spec.
_SCHEMAS: dict[str, Schema] = {}


def _key(schema: Schema) -> str:
    k = repr(schema)
    _SCHEMAS[k] = schema
    return k


# Random JSON values of every type, one level deep (st.recursive costs several times as much per
# draw; nesting comes from the lists and objects of the schemas instead).
_SCALARS: SearchStrategy[Any] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
JSON_VALUES: SearchStrategy[Any] = st.one_of(
    st.sampled_from(ODD_VALUES),
    _SCALARS,
    st.lists(_SCALARS, max_size=3),
    st.dictionaries(st.text(max_size=6), _SCALARS, max_size=2),
)


@cache
def _valid(spec: Spec, key: str) -> SearchStrategy[Any]:
    s = spec.resolve(_SCHEMAS[key])
    if "enum" in s:
        return st.sampled_from(s["enum"])
    if "const" in s:
        return st.just(s["const"])
    if "anyOf" in s:
        return st.one_of([spec.valid(b) for b in s["anyOf"]])
    types = s.get("type", [])
    types = [types] if isinstance(types, str) else list(types)
    options: list[SearchStrategy[Any]] = []
    for t in types:
        if t == "null":
            options.append(st.none())
        elif t == "boolean":
            options.append(st.booleans())
        elif t == "integer":
            options.append(st.integers(s.get("minimum"), s.get("maximum")))
        elif t == "number":
            lo = s.get("exclusiveMinimum", s.get("minimum"))
            hi = s.get("maximum")
            exclude = "exclusiveMinimum" in s
            options.append(st.floats(lo, hi, exclude_min=exclude, allow_nan=False, allow_infinity=False))
        elif t == "string":
            lo = s.get("minLength", 0)
            options.append(st.text(min_size=lo, max_size=min(s.get("maxLength", 12), max(lo, 12))))
        elif t == "array":
            lo = s.get("minItems", 0)
            hi = min(s.get("maxItems", lo + 3), lo + 3)
            options.append(st.lists(spec.valid(s.get("items", {})), min_size=lo, max_size=hi))
        elif t == "object" and isinstance(s.get("additionalProperties"), dict):
            names = s.get("propertyNames", {})
            keys = [k for k in spec._key_candidates(s) if spec.conforms(names, k)]
            options.append(
                st.dictionaries(
                    st.sampled_from(keys),
                    spec.valid(s["additionalProperties"]),
                    max_size=min(3, s.get("maxProperties", 3)),
                )
            )
        elif t == "object":
            props = s.get("properties", {})
            req = set(s.get("required", []))
            options.append(
                st.fixed_dictionaries(
                    {k: spec.valid(props[k]) for k in sorted(req)},
                    optional={k: spec.valid(p) for k, p in sorted(props.items()) if k not in req},
                )
            )
    if not options:
        return st.sampled_from([v for v in spec.boundary(s) if spec.conforms(s, v)])
    schema = _SCHEMAS[key]
    made = st.one_of(options)
    # (only rules the construction above does not follow need a check: it costs draws)
    if "if" in s or "not" in s:
        made = made.filter(lambda v: spec.conforms(schema, v))
    return made


@cache
def _invalid(spec: Spec, key: str) -> SearchStrategy[Any]:
    schema = _SCHEMAS[key]
    s = spec.resolve(schema)
    sources: list[SearchStrategy[Any]] = [
        st.sampled_from([v for v in spec.boundary(s) if not spec.conforms(s, v)]),
        JSON_VALUES,
    ]
    for b in s.get("anyOf", []):
        sources.append(spec.invalid(b))  # (filtered below: invalid for every branch)
    lo_n, hi_n = s.get("minimum", s.get("exclusiveMinimum")), s.get("maximum")
    if lo_n is not None:
        sources.append(st.floats(max_value=float(lo_n), allow_nan=False, allow_infinity=False))
        sources.append(st.integers(max_value=math.floor(lo_n)))
    if hi_n is not None:
        sources.append(st.floats(min_value=float(hi_n), allow_nan=False, allow_infinity=False))
        sources.append(st.integers(min_value=math.ceil(hi_n)))
    if "maxLength" in s:
        n = s["maxLength"]
        sources.append(
            st.tuples(st.text(min_size=1, max_size=3), st.integers(n + 1, n + 64)).map(
                lambda t: (t[0] * t[1])[: t[1]]
            )
        )
    if "items" in s:
        items = s["items"]
        lo = s.get("minItems", 0)
        good = spec.valid(items)
        # a list with one invalid item among valid ones
        sources.append(
            st.tuples(
                st.lists(good, min_size=0, max_size=2), spec.invalid(items), st.lists(good, max_size=2)
            ).map(lambda t: [*t[0], t[1], *t[2]])
        )
        if "maxItems" in s:
            hi = s["maxItems"]
            sources.append(
                st.tuples(spec.valid(items), st.integers(hi + 1, hi + 4)).map(lambda t: [t[0]] * t[1])
            )
        if lo > 0:
            sources.append(st.lists(good, max_size=lo - 1))
    if "properties" in s:
        props: dict[str, Schema] = s["properties"]
        req = sorted(s.get("required", []))
        valid_obj = spec.valid(s).filter(lambda o: isinstance(o, dict))
        if s.get("additionalProperties") is False:
            sources.append(
                st.tuples(
                    valid_obj, st.text(min_size=1, max_size=12).filter(lambda k: k not in props), JSON_VALUES
                ).map(lambda t: {**t[0], t[1]: t[2]})
            )
        for k in req:
            sources.append(valid_obj.map(lambda o, k=k: {n: v for n, v in o.items() if n != k}))
        for k, p in sorted(props.items()):
            sources.append(st.tuples(valid_obj, spec.invalid(p)).map(lambda t, k=k: {**t[0], k: t[1]}))
    return st.one_of(sources).filter(lambda v: not spec.conforms(schema, v))
