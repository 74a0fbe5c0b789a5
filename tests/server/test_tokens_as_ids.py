"""vLLM's `return_tokens_as_token_ids` (a request field, and the server's default with
`--return-tokens-as-token-ids`): logprobs name each token "token_id:N" (N the id the choice's
`token_ids` hold), in completions (output, echoed prompt, top alternatives, `prompt_logprobs`),
chat (with the tokens' own bytes) and streams; the numbers and offsets are what the same request
gets with text labels."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from server_fixtures import ServerProcess, call, running_server

GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 6, "return_token_ids": True}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server("--max-num-seqs", "4") as srv:
        yield srv


def _label(i: int) -> str:
    return f"token_id:{i}"


def _completion(server: ServerProcess, **kw: Any) -> dict[str, Any]:
    status, r = call(server, "/v1/completions", {"prompt": "Once upon a time", **GREEDY, **kw})
    assert status == 200, r
    return dict(r["choices"][0])


def test_completion_tokens_are_named_by_their_ids(server: ServerProcess) -> None:
    kw: dict[str, Any] = {"logprobs": 2, "echo": True, "prompt_logprobs": 1}
    plain, ids = _completion(server, **kw), _completion(server, return_tokens_as_token_ids=True, **kw)
    every = [*ids["prompt_token_ids"], *ids["token_ids"]]
    assert ids["logprobs"]["tokens"] == [_label(i) for i in every]
    assert ids["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    assert ids["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]  # (the text's)
    assert ids["text"] == plain["text"] and plain["logprobs"]["tokens"][0] != _label(every[0])
    for got, want in zip(ids["logprobs"]["top_logprobs"][1:], plain["logprobs"]["top_logprobs"][1:]):
        assert sorted(got.values()) == sorted(want.values())
        assert all(k.startswith("token_id:") and k[9:].isdigit() for k in got)
    for entry in ids["prompt_logprobs"][1:]:
        assert all(v["decoded_token"] == _label(int(k)) for k, v in entry.items())


def test_chat_tokens_keep_their_bytes(server: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 2, **GREEDY}
    status, plain = call(server, "/v1/chat/completions", body)
    status2, ids = call(server, "/v1/chat/completions", {**body, "return_tokens_as_token_ids": True})
    assert status == status2 == 200
    got, want = ids["choices"][0]["logprobs"]["content"], plain["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in got] == [_label(i) for i in ids["choices"][0]["token_ids"]]
    assert [(t["logprob"], t["bytes"]) for t in got] == [(t["logprob"], t["bytes"]) for t in want]
    assert bytes(b for t in got for b in t["bytes"]).decode() == ids["choices"][0]["message"]["content"]


def test_a_stream_names_them_so_too(server: ServerProcess) -> None:
    status, events = call(
        server,
        "/v1/completions",
        {
            "prompt": "Once upon a time",
            **GREEDY,
            "logprobs": 1,
            "stream": True,
            "return_tokens_as_token_ids": True,
        },
    )
    chunks = [e["choices"][0] for e in events if isinstance(e, dict) and e["choices"]]
    assert status == 200
    assert [t for c in chunks for t in c["logprobs"]["tokens"]] == [
        _label(i) for c in chunks for i in c["token_ids"]
    ]


def test_the_server_flag_is_the_default_a_request_may_turn_off() -> None:
    with running_server("--return-tokens-as-token-ids") as server:
        on, off = (
            _completion(server, logprobs=1),
            _completion(server, logprobs=1, return_tokens_as_token_ids=False),
        )
    assert on["logprobs"]["tokens"] == [_label(i) for i in on["token_ids"]]
    assert not any(t.startswith("token_id:") for t in off["logprobs"]["tokens"])
    assert on["logprobs"]["token_logprobs"] == off["logprobs"]["token_logprobs"]
