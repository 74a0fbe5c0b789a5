"""The OpenAPI document (server/openapi.py) against the validators it describes (server/protocol.py):
the same fields, and at every bound, enum and type the document states, the validator accepts
what the document accepts and refuses what it refuses, naming the field. The fuzz test
(test_server_fuzz.py) sends the same kind of values to a real server."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest

from hybridserve.server import protocol as P
from hybridserve.server import responses as R
from hybridserve.server.app import create_app
from hybridserve.server.openapi import document
from openapi_cases import Spec

MODEL = "demo"
MAX_MODEL_LEN = 64
VOCAB = 100
MAX_LOGPROBS = 7  # (--max-logprobs; not the default 20, so that a bound left at 20 shows)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


class FakeInfo:
    """protocol.ModelInfo where every text and every chat is one token: the document cannot state
    how many tokens a text is, so its bounds assume the room a one-token prompt leaves."""

    max_model_len = MAX_MODEL_LEN
    vocab_size: int | None = VOCAB
    max_logprobs = MAX_LOGPROBS
    response_role = "assistant"
    sampling_defaults: dict[str, Any] = {}  # noqa: RUF012 - read only

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1]

    def encode_many(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [[1] for _ in texts]

    def text_offsets(self, text: str, token_ids: list[int]) -> list[int] | None:
        return None

    def min_tokens(self, text: str) -> int:
        return 0

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, **kwargs: Any
    ) -> list[int]:
        return [1]


SPEC = Spec(
    document(
        served_model_name=MODEL, max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB, max_logprobs=MAX_LOGPROBS
    )
)
# the document of a server that ignores unknown fields (the default; not --strict-request-fields)
LAX_SPEC = Spec(
    document(
        served_model_name=MODEL,
        max_model_len=MAX_MODEL_LEN,
        vocab_size=VOCAB,
        max_logprobs=MAX_LOGPROBS,
        strict_request_fields=False,
    )
)
# vLLM's tokenizer routes: /tokenize takes either of the first two bodies
TOKENIZE, TOKENIZE_CHAT, DETOKENIZE = "TokenizeCompletionRequest", "TokenizeChatRequest", "DetokenizeRequest"
PARSERS: dict[str, Callable[..., Any]] = {
    COMPLETIONS: P.parse_completion_request,
    CHAT: P.parse_chat_request,
    TOKENIZE: P.parse_tokenize_request,
    TOKENIZE_CHAT: P.parse_tokenize_request,
    DETOKENIZE: P.parse_detokenize_request,
}
# The smallest valid body of each route: one prompt token.
BASES: dict[str, dict[str, Any]] = {
    COMPLETIONS: {"prompt": [1]},
    CHAT: {"messages": [{"role": "user", "content": "x"}]},
    TOKENIZE: {"prompt": "x"},
    TOKENIZE_CHAT: {"messages": [{"role": "user", "content": "x"}]},
    DETOKENIZE: {"tokens": [1]},
}


def request_schema(spec: Spec, route: str) -> dict[str, Any]:
    """A route's body (a path), or a body schema by its name (the tokenizer routes')."""
    if route.startswith("/"):
        return spec.request_schema(route)
    return spec.resolve({"$ref": f"#/components/schemas/{route}"})


def companions(field: str, value: Any) -> dict[str, Any]:
    """Other fields a value of `field` needs to be valid: the rules between fields that the
    document states in its descriptions (not in its schemas)."""
    if field == "stream_options":
        return {"stream": True}
    if field == "top_logprobs":
        return {"logprobs": True}
    if field == "best_of" and SPEC.conforms(SPEC.request_schema(COMPLETIONS)["properties"]["n"], value):
        return {"n": value}
    if field == "tool_choice":  # every choice but none needs tools; a named one, a tool of its name
        fn = value.get("function") if isinstance(value, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        # (a name the tools' own rule refuses would make the refusal the tools' field's)
        named = name if isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name) else "f"
        return {"tools": [{"type": "function", "function": {"name": named}}]}
    if field == "min_tokens" and isinstance(value, int) and not isinstance(value, bool):
        return {"max_tokens": min(max(value, 1), MAX_MODEL_LEN - 1)}
    return {}


def parse(path: str, body: dict[str, Any], strict: bool = True) -> P.APIError | None:
    # through JSON, as a server gets it
    decoded = P.decode_json_body(json.dumps(body, allow_nan=False).encode())
    try:
        PARSERS[path](decoded, FakeInfo(), MODEL, strict=strict)
    except P.APIError as e:
        return e
    return None


def test_the_document_has_every_field_the_validators_accept_and_no_other():
    for path, fields in (
        (COMPLETIONS, P._COMPLETION_FIELDS),
        (CHAT, P._CHAT_FIELDS),
        (TOKENIZE, P.TOKENIZE_PROMPT_FIELDS),
        (TOKENIZE_CHAT, P.TOKENIZE_CHAT_FIELDS),
        (DETOKENIZE, P.DETOKENIZE_FIELDS),
    ):
        schema = request_schema(SPEC, path)
        assert set(schema["properties"]) == fields, path
        assert schema["additionalProperties"] is False
        assert schema["required"] == [next(iter(BASES[path]))]
        # a server that ignores unknown fields says so, at every level
        assert request_schema(LAX_SPEC, path)["additionalProperties"] is True
    schema = request_schema(SPEC, "/v1/responses")
    assert set(schema["properties"]) == R.RESPONSES_FIELDS | R.PASSTHROUGH_FIELDS
    assert schema["additionalProperties"] is False and schema["required"] == ["input"]
    assert '"additionalProperties": false' not in json.dumps(
        {k: v for k, v in LAX_SPEC.doc["components"]["schemas"].items() if k != "Error"}
    )


def test_the_document_lists_every_route_the_app_serves():
    app = create_app(None, served_model_name=MODEL)
    routes = {
        (r.method, r.resource.canonical)
        for r in app.router.routes()
        if r.method != "HEAD" and r.resource is not None
    }
    documented = {(m.upper(), p) for p, item in SPEC.doc["paths"].items() for m in item}
    assert routes == documented


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "lax"])
@pytest.mark.parametrize("path", list(PARSERS))
def test_the_validator_agrees_with_the_document_at_every_bound(path, strict):
    spec = SPEC if strict else LAX_SPEC
    schema = request_schema(spec, path)
    checked = 0
    for field, prop in sorted(schema["properties"].items()):
        values = spec.boundary(prop)
        accepted = [v for v in values if spec.conforms(prop, v)]
        # both sides of each bound are probed
        assert accepted and len(accepted) < len(values), field
        for key in ("minimum", "maximum"):
            if key in prop:
                assert any(v == prop[key] for v in accepted), (field, key)
        for value in values:
            body = {**BASES[path], **companions(field, value), field: value}
            err = parse(path, body, strict)
            shown = repr(value)[:120]
            if spec.conforms(prop, value):
                assert err is None, f"{path} {field}={shown}: the document accepts it, the server says {err}"
            else:
                assert err is not None, (
                    f"{path} {field}={shown}: the document refuses it, the server accepts it"
                )
                assert 400 <= err.status < 500
                assert err.param is not None and err.param.split(".")[0].split("[")[0] == field, (
                    field,
                    shown,
                    err.param,
                    err.message,
                )
            checked += 1
    assert checked > (300 if path.startswith("/") else 40), checked


def test_a_body_without_its_required_field_is_refused():
    for path in (COMPLETIONS, CHAT):
        err = parse(path, {"max_tokens": 1})
        assert err is not None and err.param == SPEC.request_schema(path)["required"][0]


def test_the_document_leaves_model_bounds_out_until_the_model_is_loaded():
    doc = document(served_model_name=MODEL)
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert "maximum" not in props["max_tokens"]
    assert props["min_tokens"]["maximum"] == 2**31 - 1
    assert "securitySchemes" not in doc["components"]
    secured = document(served_model_name=MODEL, api_key_required=True)
    assert secured["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in secured["paths"]["/health"]["get"]


async def test_the_app_serves_the_document_while_loading_and_without_a_key(aiohttp_client):
    client = await aiohttp_client(create_app(None, served_model_name=MODEL, api_key="k3y"))
    r = await client.get("/openapi.json")
    assert r.status == 200 and r.content_type == "application/json"
    doc = await r.json()
    assert doc["openapi"].startswith("3.1")
    assert doc == document(served_model_name=MODEL, api_key_required=True, strict_request_fields=False)
    strict = await aiohttp_client(create_app(None, served_model_name=MODEL, strict_request_fields=True))
    r = await strict.get("/openapi.json")
    assert await r.json() == document(served_model_name=MODEL)
