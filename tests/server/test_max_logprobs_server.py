"""`--max-logprobs N` through the HTTP server: every field that asks for log-probabilities per
token (completions' `logprobs` and `prompt_logprobs`, chat's `top_logprobs` and
`prompt_logprobs`, the Responses API's `top_logprobs`) takes up to N, a request over it is a 400
that names the field, the OpenAPI document says the bound, and a beam search is held to N / 2."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from server_fixtures import ServerProcess, call, running_server

LIMIT = 4


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server("--max-logprobs", str(LIMIT), "--max-model-len", "256") as srv:
        yield srv


CHAT = {"model": "demo", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
CASES = [
    ("/v1/completions", {"model": "demo", "prompt": "Hi", "max_tokens": 2}, "logprobs", {}),
    ("/v1/completions", {"model": "demo", "prompt": "Hi", "max_tokens": 2}, "prompt_logprobs", {}),
    ("/v1/chat/completions", CHAT, "top_logprobs", {"logprobs": True}),
    ("/v1/chat/completions", CHAT, "prompt_logprobs", {}),
    ("/v1/responses", {"model": "demo", "input": "Hello", "max_output_tokens": 2}, "top_logprobs",
     {"include": ["message.output_text.logprobs"]}),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "field", "extra"), CASES)
def test_up_to_the_limit_and_no_further(
    server: ServerProcess, path: str, body: dict[str, object], field: str, extra: dict[str, object]
) -> None:
    status, out = call(server, path, {**body, **extra, field: LIMIT})
    assert status == 200, out
    status, err = call(server, path, {**body, **extra, field: LIMIT + 1})
    assert status == 400, err
    assert err["error"]["param"] == field and f"[0, {LIMIT}]" in err["error"]["message"]


def test_the_completion_carries_the_limit_s_alternatives(server: ServerProcess) -> None:
    status, out = call(
        server, "/v1/completions", {"model": "demo", "prompt": "Hi", "max_tokens": 3, "logprobs": LIMIT}
    )
    assert status == 200, out
    tops = out["choices"][0]["logprobs"]["top_logprobs"]
    assert len(tops) == 3 and all(len(t) >= LIMIT for t in tops)


def test_the_openapi_document_says_the_bound(server: ServerProcess) -> None:
    status, doc = call(server, "/openapi.json")
    assert status == 200
    schemas = doc["components"]["schemas"]
    bounds = {
        (name, field): schemas[name]["properties"][field]["maximum"]
        for name in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest")
        for field in ("logprobs", "prompt_logprobs", "top_logprobs")
        if "maximum" in schemas[name]["properties"].get(field, {})
    }
    assert len(bounds) == 5 and set(bounds.values()) == {LIMIT}, bounds


def test_a_beam_search_is_held_to_half_of_it(server: ServerProcess) -> None:
    beam = {"model": "demo", "prompt": "Hi", "max_tokens": 2, "use_beam_search": True}
    status, out = call(server, "/v1/completions", {**beam, "n": LIMIT // 2})
    assert status == 200 and len(out["choices"]) == LIMIT // 2, out
    status, err = call(server, "/v1/completions", {**beam, "n": LIMIT // 2 + 1})
    assert status == 400 and err["error"]["param"] == "n"
    assert f"at most {LIMIT // 2} " in err["error"]["message"] and "--max-logprobs" in err["error"]["message"]
