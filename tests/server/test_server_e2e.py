"""End to end: one real `hybridserve serve demo` subprocess (real engine, demo model) for the whole
module, driven by the official `openai` client and by raw HTTP (aiohttp) for SSE framing, error
bodies, /metrics, disconnects and concurrency."""

from __future__ import annotations

import asyncio
import codecs
import functools
import io
import json
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import aiohttp
import openai
import pytest

from hybridserve.engine.tokenizer import Tokenizer
from hybridserve.model.demo import ensure_demo_model
from hybridserve.sampling.params import MAX_STOP_STR_LEN
from hybridserve.server import protocol as P
from server_fixtures import (
    ServerProcess,
    TokenizerModelInfo,
    assert_idle,
    held,
    parse_metrics,
    parse_sse,
    post_and_hold,
    raw_http,
    wait_idle,
)

MODEL = "demo"
PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Say something about foxes."}]

# Engine flags the shared server runs with (small context so the limit tests stay cheap).
SERVER_ARGS: tuple[str, ...] = (
    "--max-model-len",
    "256",
    "--mamba-block-size",
    "64",
    "--body-read-timeout",
    "5",
    "--keep-alive-timeout",
    "8",  # above httpx's 5 s pool expiry, so the openai client never reuses a connection we closed
)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    ensure_demo_model()
    srv = ServerProcess(*SERVER_ARGS)
    try:
        srv.wait_ready()
        yield srv
    finally:
        rc = srv.stop()  # SIGTERM: a graceful shutdown exits 0
    assert rc == 0, srv.output()[-3000:]
    assert "stopped" in srv.output()
    srv.remove_log()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(
    server: ServerProcess,
    path: str,
    body: Any = None,
    *,
    data: bytes | None = None,
    content_type: str = "application/json",
    **kw: Any,
) -> tuple[int, Any, dict]:
    async def go() -> tuple[int, Any, dict]:
        async with aiohttp.ClientSession() as s:
            raw_body = data if data is not None else json.dumps(body).encode()
            # a stream, not bytes: aiohttp warns that a large bytes body blocks the loop
            payload = io.BytesIO(raw_body)
            async with s.post(
                server.base + path, data=payload, headers={"Content-Type": content_type}, **kw
            ) as r:
                transport = r.connection.transport if r.connection is not None else None
                raw = await r.read()
                if transport is not None and transport.is_closing():
                    # The server answered before reading the whole body (a 413) and closed: the
                    # unsent rest of the body would keep the transport open until the loop closes.
                    transport.abort()
                try:
                    parsed: Any = json.loads(raw)
                except ValueError:
                    parsed = raw
                return r.status, parsed, dict(r.headers)

    return asyncio.run(go())


def stream_raw(server: ServerProcess, path: str, body: dict) -> tuple[int, dict, bytes]:
    async def go() -> tuple[int, dict, bytes]:
        async with aiohttp.ClientSession() as s:
            async with s.post(server.base + path, json=body) as r:
                return r.status, dict(r.headers), await r.read()

    return asyncio.run(go())


def metrics(server: ServerProcess) -> dict[str, float]:
    async def go() -> str:
        async with aiohttp.ClientSession() as s:
            async with s.get(server.base + "/metrics") as r:
                assert r.status == 200
                assert r.headers["Content-Type"].startswith("text/plain")
                return await r.text()

    return parse_metrics(asyncio.run(go()))


def max_model_len(client: openai.OpenAI) -> int:
    card = client.models.list().data[0]
    return int(card.model_extra["max_model_len"])


# ------------------------------------------------------------------------- openai client


def test_models_and_health(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert max_model_len(client) == 256
    assert server.health_status() == 200
    # the server listened before the model was loaded: every /health answer was 503 until ready
    assert server.health_seen[-1] == 200 and set(server.health_seen[:-1]) <= {503}


def test_completion_stream_matches_non_stream(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert full.object == "text_completion" and full.model == MODEL and full.id.startswith("cmpl-")
    (choice,) = full.choices
    assert choice.index == 0 and choice.finish_reason in ("length", "stop")
    assert full.usage.completion_tokens >= 1 and full.usage.completion_tokens <= 8
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert full.usage.prompt_tokens_details.cached_tokens >= 0
    if choice.finish_reason == "length":
        assert full.usage.completion_tokens == 8

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    body = chunks[:-1]
    assert all(c.usage is None for c in body) and len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in body) == choice.text
    assert body[-1].choices[0].finish_reason == choice.finish_reason
    assert all(c.choices[0].finish_reason is None for c in body[:-1])


def test_chat_stream_matches_non_stream(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    (choice,) = full.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("length", "stop")
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0, stream=True)
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert full.usage.completion_tokens <= 8


def test_a_chat_stream_of_several_choices_begins_with_each_role_in_order(client):
    # as vLLM and OpenAI: a role-only chunk per choice, in index order, before any token. The
    # openai SDK's stream helper builds its choices from them: a choice whose first chunk came
    # before a lower index's failed it (IndexError), and a first chunk with tokens had its
    # logprobs taken twice
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 6, "temperature": 0, "n": 3, "logprobs": True}
    body["extra_body"] = {"ignore_eos": True}
    chunks = list(client.chat.completions.create(**body, stream=True))
    firsts = [c.choices[0] for c in chunks[:3]]
    assert [(f.index, f.delta.role, f.delta.content, f.logprobs) for f in firsts] == [
        (i, "assistant", "", None) for i in range(3)
    ]
    assert all(c.choices[0].delta.role is None for c in chunks[3:] if c.choices)
    # with continuous usage, a role chunk counts its prompt and no token made yet
    usage = {"include_usage": True, "continuous_usage_stats": True}
    counted = list(client.chat.completions.create(**body, stream=True, stream_options=usage))  # type: ignore[call-overload]
    assert [c.usage.completion_tokens for c in counted[:3]] == [0, 0, 0]
    assert {c.usage.prompt_tokens for c in counted[:4]} == {counted[4].usage.prompt_tokens}  # (one prompt)
    full = client.chat.completions.create(**body)
    with client.chat.completions.stream(**body) as events:
        for _ in events:
            pass
        final = events.current_completion_snapshot  # (the final one refuses a "length" finish)
    for got, want in zip(sorted(final.choices, key=lambda c: c.index), full.choices, strict=True):
        assert got.message.content == want.message.content
        assert [t.token for t in got.logprobs.content] == [t.token for t in want.logprobs.content]


def test_chat_prompt_is_the_model_template(client):
    info = TokenizerModelInfo(ensure_demo_model(), max_model_len=256)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, temperature=0)
    rendered = "<|im_start|>user\nSay something about foxes.<|im_end|>\n<|im_start|>assistant\n"
    assert r.usage.prompt_tokens == len(info.encode(rendered)) == len(info.encode_chat(CHAT, True))


def test_stop_string_echo_and_token_prompt(client):
    base = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0]
    assert len(base.text) >= 4
    stop = base.text[2:4]
    cut = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop]
    ).choices[0]
    assert cut.finish_reason == "stop" and cut.model_extra["stop_reason"] == stop
    assert cut.text == base.text[: base.text.index(stop)]
    echoed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True
    ).choices[0]
    assert (
        echoed.text.startswith(PROMPT)
        and echoed.text[len(PROMPT) :] == base.text[: len(echoed.text) - len(PROMPT)]
    )
    # the same prompt as token ids gives the same greedy output
    ids = TokenizerModelInfo(ensure_demo_model()).encode(PROMPT)
    by_ids = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0]
    assert by_ids.text == base.text
    # echo of token ids honours skip_special_tokens (434, 2, 434: "The", <|im_end|>, "The")
    for skip, want in ((False, "The<|im_end|>The"), (True, "TheThe")):
        echo_ids = client.completions.create(
            model=MODEL,
            prompt=[434, 2, 434],
            max_tokens=1,
            temperature=0,
            echo=True,
            extra_body={"skip_special_tokens": skip},
        ).choices[0]
        assert echo_ids.text.startswith(want), (skip, echo_ids.text)


def test_stop_reason_is_null_on_eos_and_the_token_id_on_a_stop_token(client):
    # [1, 2, 3] leads greedy decoding to EOS (id 2) as its 5th token, with 536 as its 3rd
    eos = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=8, temperature=0).choices[0]
    assert eos.finish_reason == "stop" and eos.model_extra["stop_reason"] is None
    tok = client.completions.create(
        model=MODEL, prompt=[1, 2, 3], max_tokens=8, temperature=0, extra_body={"stop_token_ids": [536]}
    ).choices[0]
    assert tok.finish_reason == "stop" and tok.model_extra["stop_reason"] == 536
    assert (
        client.completions.create(
            model=MODEL, prompt=[1, 2, 3], max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .finish_reason
        == "length"
    )


def test_a_long_prompt_without_max_tokens_gets_the_room_left(client):
    limit = max_model_len(client)
    r = client.completions.create(
        model=MODEL, prompt=[5] * (limit - 3), temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    r = client.completions.create(
        model=MODEL, prompt=[5] * 10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 16  # OpenAI's default
    # several prompts: each takes the default within the room it leaves itself (the short one is
    # not cut to what the long one leaves), n choices alike, sampled or beam-searched
    for extra in ({"n": 2}, {"n": 2, "use_beam_search": True}):
        r = client.completions.create(
            model=MODEL,
            prompt=[[5] * 10, [5] * (limit - 3)],
            temperature=0,
            extra_body={"ignore_eos": True, **extra},
        )
        assert r.usage.completion_tokens == 2 * 16 + 2 * 3, (extra, r.usage)
        assert [c.finish_reason for c in r.choices] == ["length"] * 4, (extra, r.choices)


def test_only_json_bodies_are_read(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "application/json; charset=latin-1"):
        status, parsed, _ = post(server, "/v1/completions", body, content_type=ctype)
        assert status == 415, (ctype, parsed)
        assert parsed["error"]["code"] == "unsupported_media_type" and "application/json" in str(parsed), (
            parsed
        )
    for ctype in ("application/json; charset=UTF-8", "Application/JSON", "application/merge-patch+json"):
        status, parsed, _ = post(server, "/v1/completions", body, content_type=ctype)
        assert status == 200 and parsed["usage"]["completion_tokens"] == 2, (ctype, parsed)
    # a body without a Content-Type is what a page's fetch with a Blob body or sendBeacon sends,
    # without a CORS preflight: refused too
    payload = json.dumps(body).encode()
    head, parsed = raw_http(
        server,
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: "
        + str(len(payload)).encode()
        + b"\r\n\r\n"
        + payload,
    )
    assert head.startswith(b"HTTP/1.1 415"), head
    assert (
        parsed["error"]["code"] == "unsupported_media_type" and "Content-Type" in parsed["error"]["message"]
    )


def test_a_declared_oversized_body_is_refused_before_it_is_sent(server):
    def post(rest: bytes) -> tuple[bytes, dict]:
        return raw_http(
            server,
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + rest,
        )

    head, body = post(b"Content-Length: 99999999999\r\n\r\n{}")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert body["error"]["code"] == "request_too_large"
    # with Expect: 100-continue the client is not invited to send it first
    head, body = post(b"Expect: 100-continue\r\nContent-Length: 99999999999\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert body["error"]["code"] == "request_too_large"
    head, body = post(b"Expect: something-else\r\nContent-Length: 2\r\n\r\n{}")
    assert head.startswith(b"HTTP/1.1 417"), head
    assert body["error"]["code"] == "expectation_failed"


def test_an_expected_body_of_allowed_size_is_invited_and_served(server):
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}).encode()
    import socket

    host, port = server.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
        )
        interim = b""
        while b"\r\n\r\n" not in interim:
            interim += sock.recv(1)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert json.loads(payload)["usage"]["completion_tokens"] == 2


def test_n_choices_and_seeds(client):
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, n=3)
    assert sorted(c.index for c in greedy.choices) == [0, 1, 2]
    assert len({c.text for c in greedy.choices}) == 1  # greedy: every choice is the same
    single = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert greedy.choices[0].text == single.choices[0].text
    assert greedy.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once
    assert greedy.usage.completion_tokens == 3 * single.usage.completion_tokens
    a = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=1.0,
        seed=123,
        n=2,
        extra_body={"ignore_eos": True},
    )
    b = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=1.0,
        seed=123,
        n=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    # any int64 is a seed, as vLLM takes it
    neg = [
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=6,
            temperature=1.0,
            seed=-(2**63),
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert neg[0] == neg[1]
    # prompts x n in one completions request
    batch = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=3, temperature=0, n=2)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in batch.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]


def test_completion_logprobs_shape(client):
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert n == 5
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0.0
        assert 1 <= len(top) <= 3 and tok in top
        assert chosen == pytest.approx(max(top.values()))  # greedy: the chosen token is the best
    stream = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=5,
            temperature=0,
            logprobs=2,
            extra_body={"ignore_eos": True},
            stream=True,
        )
    )
    tokens = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def _label_bytes(label: str) -> bytes:
    if label.startswith("bytes:"):
        return bytes(int(h, 16) for h in label[len("bytes:") :].split("\\x")[1:])
    return label.encode("utf-8")


def _utf8_piece_bias() -> dict[str, int]:
    """A logit bias on the byte tokens of "é" and "日" (the demo tokenizer has no merges for them:
    its corpus is ASCII), which the trained demo model would otherwise almost never sample."""
    ids = TokenizerModelInfo(ensure_demo_model()).encode("é日")
    assert len(ids) == 5
    return {str(i): 8 for i in ids}


def test_logprobs_of_pieces_of_characters(client):
    # temperature 2 on the demo model, with the bias, samples byte tokens that are pieces of UTF-8
    # characters
    bias = _utf8_piece_bias()
    r = client.completions.create(
        model=MODEL, prompt="Once", max_tokens=40, temperature=2.0, seed=5, logprobs=5,
        logit_bias=bias, extra_body={"ignore_eos": True},
    )  # fmt: skip
    c = r.choices[0]
    lp = c.logprobs
    assert any(t.startswith("bytes:") for t in lp.tokens), lp.tokens  # the case under test happened
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # distinct tokens, distinct labels: the top 5 plus the chosen one, nothing overwritten
        assert len(top) == (5 if tok in list(top)[:5] else 6), top
        assert top[tok] == pytest.approx(chosen)
    # the labels' bytes are the text's bytes, and each offset counts the characters completed before
    assert b"".join(_label_bytes(t) for t in lp.tokens).decode("utf-8", errors="replace") == c.text
    # a token that starts a character starts after everything before it (an unfinished character
    # before it is one U+FFFD); a piece that continues a character shares that character's offset
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    before, completed = b"", ""
    for tok, off in zip(lp.tokens, lp.text_offset):
        raw = _label_bytes(tok)
        continues = bool(raw) and 0x80 <= raw[0] <= 0xBF
        want = len(completed) if continues else len(before.decode("utf-8", errors="replace"))
        assert off == want <= len(c.text), (tok, off, want)
        before += raw
        completed += utf8.decode(raw)
    # streamed: the same tokens and offsets, whatever deltas split the characters
    chunks = client.completions.create(
        model=MODEL, prompt="Once", max_tokens=40, temperature=2.0, seed=5, logprobs=5,
        logit_bias=bias, extra_body={"ignore_eos": True}, stream=True,
    )  # fmt: skip
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for x in streamed for t in x.tokens] == lp.tokens
    assert [o for x in streamed for o in x.text_offset] == lp.text_offset
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=40, temperature=2.0, seed=5, logprobs=True, top_logprobs=3,
        logit_bias=bias,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert any(e.token.startswith("bytes:") for e in content)
    assert all(bytes(e.bytes) == _label_bytes(e.token) for e in content)
    assert all(bytes(t.bytes) == _label_bytes(t.token) for e in content for t in e.top_logprobs)


def test_chat_logprobs_shape(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    for item in content:
        assert item.logprob <= 0 and item.bytes == list(item.token.encode("utf-8"))
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)  # greedy
        assert [t.logprob for t in item.top_logprobs] == sorted(
            (t.logprob for t in item.top_logprobs), reverse=True
        )


# ------------------------------------------------------------------------- return_token_ids


@functools.cache
def offline_llm() -> Any:
    """The engine of the server's configuration, without HTTP (float32, as the server's "auto")."""
    from hybridserve import LLM

    return LLM("demo", dtype="float32", max_model_len=256, mamba_block_size=64)


def _stream_events(server: ServerProcess, path: str, body: dict) -> list[dict]:
    status, _, raw = stream_raw(server, path, {**body, "stream": True})
    assert status == 200, raw[:300]
    events = parse_sse(raw)
    assert events[-1] == "[DONE]"
    return events[:-1]


def test_return_token_ids_are_the_engines_tokens(server, client):
    from hybridserve import SamplingParams

    prompts = [PROMPT, "Hello"]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 10, "temperature": 0, "n": 2,
            "return_token_ids": True}  # fmt: skip
    status, full, _ = post(server, "/v1/completions", body)
    assert status == 200, full
    ref = offline_llm().generate(prompts, SamplingParams(max_tokens=10, temperature=0))
    choices = sorted(full["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for c in choices:
        want = ref[c["index"] // 2]  # n = 2 choices per prompt, each with its own prompt's ids
        assert c["prompt_token_ids"] == want.prompt_token_ids
        assert c["token_ids"] == want.outputs[0].token_ids
        assert c["text"] == want.outputs[0].text
    assert full["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)
    # streamed: every chunk carries the ids new in it, the first chunk of each choice the prompt's
    events = _stream_events(server, "/v1/completions", body)
    for c in choices:
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == c["index"]]
        assert mine[0]["prompt_token_ids"] == c["prompt_token_ids"]
        assert all("prompt_token_ids" not in x for x in mine[1:])
        assert all("token_ids" in x for x in mine)
        assert [t for x in mine for t in x["token_ids"]] == c["token_ids"]
        assert "".join(x["text"] for x in mine) == c["text"]
    # the openai client reads them too (as vLLM's extra fields)
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, extra_body={"return_token_ids": True}
    )
    assert r.choices[0].model_extra["token_ids"] == ref[0].outputs[0].token_ids
    # not asked for: not there
    status, plain, _ = post(server, "/v1/completions", {**body, "return_token_ids": False})
    assert status == 200
    assert all("token_ids" not in c and "prompt_token_ids" not in c for c in plain["choices"])
    events = _stream_events(server, "/v1/completions", {**body, "n": 1, "return_token_ids": False})
    assert all(
        "token_ids" not in e["choices"][0] and "prompt_token_ids" not in e["choices"][0] for e in events
    )


def test_return_token_ids_end_at_the_token_that_stopped(server):
    def complete(**extra: Any) -> dict:
        body = {
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": 12,
            "temperature": 0,
            "return_token_ids": True,
        }
        status, r, _ = post(server, "/v1/completions", {**body, **extra})
        assert status == 200, r
        return r["choices"][0]

    tok = TokenizerModelInfo(ensure_demo_model()).tokenizer
    base = complete(ignore_eos=True)
    assert len(base["token_ids"]) == 12 and len(base["text"]) >= 6
    stop = base["text"][3:6]
    # a stop string cuts the text, not the ids: they run up to and including the token whose text
    # completed the stop string (as vLLM), which is what the engine generated and caches
    for include in (False, True):
        cut = complete(stop=[stop], include_stop_str_in_output=include)
        assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
        ids = cut["token_ids"]
        assert ids == base["token_ids"][: len(ids)]
        assert stop in tok.decode(ids) and stop not in tok.decode(ids[:-1])
        assert cut["text"] == base["text"][: base["text"].index(stop) + (len(stop) if include else 0)]
        streamed = _stream_events(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 12,
                                  "temperature": 0, "return_token_ids": True, "stop": [stop],
                                  "include_stop_str_in_output": include})  # fmt: skip
        assert [t for e in streamed for t in e["choices"][0]["token_ids"]] == ids
        assert "".join(e["choices"][0]["text"] for e in streamed) == cut["text"]
    # EOS and a stop token id are the last ids (neither is in the text)
    status, eos, _ = post(server, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0,
                                                      "return_token_ids": True})  # fmt: skip
    assert eos["choices"][0]["finish_reason"] == "stop" and eos["choices"][0]["token_ids"][-1] == 2
    status, st, _ = post(server, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0,
                                                     "return_token_ids": True, "stop_token_ids": [536]})  # fmt: skip
    assert st["choices"][0]["stop_reason"] == 536 and st["choices"][0]["token_ids"][-1] == 536


def test_chat_return_token_ids(server):
    from hybridserve import SamplingParams

    info = TokenizerModelInfo(ensure_demo_model(), max_model_len=256)
    prompt_ids = info.encode_chat(CHAT, True)
    body = {
        "model": MODEL,
        "messages": CHAT,
        "max_tokens": 8,
        "temperature": 0,
        "n": 2,
        "return_token_ids": True,
    }
    status, full, _ = post(server, "/v1/chat/completions", body)
    assert status == 200, full
    # as vLLM: a chat request has one prompt, its ids are on the response; the output ids on each choice
    assert full["prompt_token_ids"] == prompt_ids
    want = offline_llm().generate(
        {"prompt_token_ids": prompt_ids}, SamplingParams(max_tokens=8, temperature=0)
    )
    for c in full["choices"]:
        assert c["token_ids"] == want[0].outputs[0].token_ids and "prompt_token_ids" not in c
        assert c["message"]["content"] == want[0].outputs[0].text
    events = _stream_events(server, "/v1/chat/completions", body)
    for index in (0, 1):
        mine = [e for e in events if e["choices"][0]["index"] == index]
        assert (
            mine[0]["prompt_token_ids"] == prompt_ids
            and mine[0]["choices"][0]["delta"]["role"] == "assistant"
        )
        assert all("prompt_token_ids" not in e for e in mine[1:])
        assert [t for e in mine for t in e["choices"][0]["token_ids"]] == want[0].outputs[0].token_ids
    status, plain, _ = post(server, "/v1/chat/completions", {**body, "return_token_ids": None})
    assert "prompt_token_ids" not in plain and all("token_ids" not in c for c in plain["choices"])


def test_cached_tokens_match_the_engine_counters(server, client):
    prompt = "A long shared prefix about mamba state caching and attention blocks. " * 4
    hits = "hybridserve_prefix_cache_hit_tokens_total"
    counted = []
    first_seen = wait_idle(server)
    for _ in range(3):
        start = wait_idle(server)
        done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        counted.append((done, wait_idle(server)[hits] - start[hits]))
    (first, _), (second, _), (third, _) = counted
    # hits are reported by where their checkpoint came from: a grid point, then a branch point
    last = wait_idle(server)
    for source, n, tokens in (("grid", 1, 64), ("branch", 1, 112), ("last_token", 0, 0)):
        for name, want in (("hits_by_source", n), ("hit_tokens_by_source", tokens)):
            key = f'hybridserve_prefix_cache_{name}_total{{source="{source}"}}'
            assert last[key] - first_seen[key] == want, key
    lost = "hybridserve_prefix_cache_lost_tokens_total"
    assert last[lost] - first_seen[lost] == 112 - 64  # the repeat found KV past its state
    assert last["hybridserve_mamba_checkpoint_bytes"] > 0
    for c, diff in counted:
        assert c.usage.prompt_tokens_details.cached_tokens == diff
        assert c.choices[0].text == first.choices[0].text
    # 117 prompt tokens: the first run keeps its state after its last token and, in spare room,
    # at the grid point 64; the repeat hits 64, finds 112 tokens of KV (7 blocks) past it and keeps
    # a state there; the third hits 112
    assert [c.usage.prompt_tokens_details.cached_tokens for c, _ in counted] == [0, 64, 112]
    # another tenant's salt never sees this prefix
    salted = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body={"cache_salt": "tenant-b"}
    )
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    assert salted.choices[0].text == first.choices[0].text


def test_the_second_user_of_a_system_prompt_hits_it(server, client):
    """A chat's system message ends with the template's end-of-message token: the first request
    keeps the state at the last whole block of it (a declared shared prefix), so the second user,
    with a message of its own, already hits the system message."""
    system = "You are the support desk of a bicycle shop; answer in one short sentence. " * 2
    key = 'hybridserve_prefix_cache_hits_by_source_total{source="declared"}'
    before = wait_idle(server)
    got = []
    for question in ("Do you sell helmets?", "When do you open?"):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=2,
            temperature=0,
        )
        got.append(r.usage.prompt_tokens_details.cached_tokens)
    # the system message's tokens: the template's header, the content, and <|im_end|>
    tok = Tokenizer(ensure_demo_model())
    declared = len(tok.encode(f"<|im_start|>system\n{system}<|im_end|>"))
    assert got == [0, declared // 16 * 16] and declared >= 32
    assert wait_idle(server)[key] - before[key] == 1


def test_openai_client_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=5)
    assert ei.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)


# ------------------------------------------------------------------------- raw HTTP


def test_sse_framing(server):
    status, headers, raw = stream_raw(
        server,
        "/v1/completions",
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True,
         "stream_options": {"include_usage": True}},
    )  # fmt: skip
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = parse_sse(raw)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert [c["usage"] is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    status, headers, raw = stream_raw(
        server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "temperature": 0, "stream": True}
    )
    events = parse_sse(raw)
    assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"


def _raw_http(server: Any, version: str, path: str, body: dict, headers: str = "") -> tuple[str, bytes]:
    """A request written by hand in HTTP/`version`, read to the server's close: (the head, the
    body as sent, chunked or not)."""

    async def go() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        data = json.dumps(body).encode()
        writer.write(
            f"POST {path} HTTP/{version}\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n{headers}\r\n".encode()
            + data
        )
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(-1), 60)  # (to the close)
        writer.close()
        return raw

    head, _, rest = asyncio.run(go()).partition(b"\r\n\r\n")
    return head.decode(), rest


def test_a_stream_to_an_http_1_0_client_ends_with_the_connection(server):
    """HTTP/1.0 (what many proxies forward as) has no chunked encoding: the stream is sent as it
    comes, without a length, and the server's close ends it."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True}
    head, rest = _raw_http(server, "1.0", "/v1/completions", body)
    assert head.startswith("HTTP/1.0 200"), head
    assert "transfer-encoding" not in head.lower() and "keep-alive" not in head.lower()
    events = parse_sse(rest)
    assert events[-1] == "[DONE]" and len(events) == 4
    # HTTP/1.1 with `Connection: close`: chunked, and told the connection closes
    head, rest = _raw_http(server, "1.1", "/v1/completions", body, "Connection: close\r\n")
    assert head.startswith("HTTP/1.1 200") and "Connection: close" in head, head
    assert "Transfer-Encoding: chunked" in head and rest.endswith(b"0\r\n\r\n")
    assert_idle(server)


def test_metrics_show_the_state_pool_capacity(server):
    m = wait_idle(server)
    # no speculation, prefix caching on: each sequence needs its window of 1 and a checkpoint slot
    # (mamba_slots_total excludes the null slot)
    capacity = m["hybridserve_mamba_state_capacity_seqs"]
    assert capacity == m["hybridserve_mamba_slots_total"] // 2
    assert m["hybridserve_max_num_seqs"] == min(64, capacity)


def test_metrics_names_and_counters(server, client):
    before = wait_idle(server)
    required = [
        "hybridserve_num_requests_running",
        "hybridserve_num_requests_waiting",
        "hybridserve_prompt_tokens_total",
        "hybridserve_generation_tokens_total",
        "hybridserve_time_to_first_token_seconds_count",
        "hybridserve_inter_token_latency_seconds_count",
        "hybridserve_kv_blocks_used",
        "hybridserve_mamba_slots_used",
        "hybridserve_prefix_cache_queried_tokens_total",
        "hybridserve_prefix_cache_hit_tokens_total",
        "hybridserve_prefix_cache_lost_tokens_total",
        "hybridserve_spec_decode_draft_tokens_total",
        "hybridserve_spec_decode_accepted_tokens_total",
        "hybridserve_mamba_checkpoint_bytes",
        "hybridserve_kv_cache_evictions_total",
        "hybridserve_kv_cache_evictions_useless_total",
        "hybridserve_mamba_checkpoints_kept_last_token_total",
        'hybridserve_mamba_checkpoint_evictions_total{cause="stale"}',
        'hybridserve_mamba_checkpoint_evictions_total{cause="for_kv"}',
        'hybridserve_prefix_cache_hits_by_source_total{source="last_token"}',
        'hybridserve_mamba_checkpoints{source="branch"}',
        'hybridserve_mamba_checkpoint_reuse_rate{source="grid"}',
    ]
    for name in required:
        assert name in before, name
    r = client.completions.create(
        model=MODEL, prompt="Counting tokens", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    after = wait_idle(server)  # the engine's stats snapshot follows its last step
    gen = after["hybridserve_generation_tokens_total"] - before["hybridserve_generation_tokens_total"]
    assert gen == r.usage.completion_tokens == 5
    prompt = after["hybridserve_prompt_tokens_total"] - before["hybridserve_prompt_tokens_total"]
    assert prompt == r.usage.prompt_tokens
    ttft = "hybridserve_time_to_first_token_seconds_count"
    itl = "hybridserve_inter_token_latency_seconds_count"
    assert after[ttft] == before[ttft] + 1
    assert after[itl] == before[itl] + 4


def test_metrics_of_request_phases_and_sizes(server, client):
    before = wait_idle(server)
    r = client.completions.create(
        model=MODEL,
        prompt="Phases of a request",
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = wait_idle(server)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(f"hybridserve_request_{phase}_time_seconds_count") == 1, phase
        assert delta(f'vllm:request_{phase}_time_seconds_count{{model_name="{MODEL}"}}') == 1, phase
    assert delta("hybridserve_request_prompt_tokens_sum") == r.usage.prompt_tokens
    assert delta("hybridserve_request_generation_tokens_sum") == 6
    assert delta('vllm:request_generation_tokens_bucket{le="5.0",model_name="demo"}') == 0
    assert delta('vllm:request_generation_tokens_bucket{le="10.0",model_name="demo"}') == 1
    # the engine's phases lie within what the server saw: queue and prefill before the first
    # token reached the server, prefill and decode within the whole request
    ttft = delta("hybridserve_time_to_first_token_seconds_sum")
    queue = delta("hybridserve_request_queue_time_seconds_sum")
    prefill = delta("hybridserve_request_prefill_time_seconds_sum")
    decode = delta("hybridserve_request_decode_time_seconds_sum")
    inference = delta("hybridserve_request_inference_time_seconds_sum")
    assert queue >= 0 and prefill > 0 and decode > 0
    assert queue + prefill <= ttft
    assert prefill + decode <= inference <= delta("hybridserve_e2e_request_latency_seconds_sum")


def test_client_disconnect_mid_stream_frees_everything(server, client):
    limit = max_model_len(client)
    prompt_len = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).usage.prompt_tokens
    max_tokens = limit - prompt_len
    before = wait_idle(server)

    async def go() -> dict[str, float]:
        async with aiohttp.ClientSession() as s:
            body = {
                "model": MODEL,
                "prompt": PROMPT,
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
            }
            r = await s.post(server.base + "/v1/completions", json=body)
            assert r.status == 200
            for _ in range(3):  # a few tokens arrive
                line = await r.content.readline()
                assert line.startswith(b"data: {")
                await r.content.readline()
            async with s.get(server.base + "/metrics") as mr:
                during = parse_metrics(await mr.text())
            r.close()  # the client goes away mid-stream
            return during

    during, after, generated = _until_cut(server, go, before, max_tokens)
    assert held(during)["running"] == 1
    assert held(during)["kv_blocks"] >= 1 and held(during)["mamba_windows"] >= 1
    assert_idle(server)
    assert 3 <= generated < max_tokens  # aborted, not run to the end
    aborted = 'hybridserve_requests_finished_total{finish_reason="abort"}'
    assert after[aborted] == before.get(aborted, 0) + 1  # counted as finished, by "abort"


def _until_cut(
    server: Any,
    go: Callable[[], Coroutine[Any, Any, dict[str, float]]],
    before: dict[str, float],
    max_tokens: int,
) -> tuple[dict[str, float], dict[str, float], float]:
    """(metrics while the request ran, metrics after, tokens generated) of a client that leaves
    during its request. The whole answer takes a fraction of a second: on a loaded machine the
    client may leave only after it ended, so a run to the end is tried again, up to three times
    in all; a server that never aborts runs to the end every time."""
    for _ in range(3):
        during = asyncio.run(go())
        after = wait_idle(server)
        generated = (
            after["hybridserve_generation_tokens_total"] - before["hybridserve_generation_tokens_total"]
        )
        if generated < max_tokens:
            break
        before = after
    return during, after, generated


def test_client_disconnect_during_non_streaming_request_aborts_it(server, client):
    limit = max_model_len(client)
    max_tokens = (
        limit - client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).usage.prompt_tokens
    )
    before = wait_idle(server)

    async def go() -> dict[str, float]:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
        writer = await post_and_hold(server, "/v1/completions", body)
        deadline = time.monotonic() + 30
        while True:  # until the engine runs it
            during = await asyncio.to_thread(metrics, server)
            if held(during)["running"] == 1 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        writer.close()  # the client goes away before the response
        await writer.wait_closed()
        return during

    during, after, generated = _until_cut(server, go, before, max_tokens)
    assert held(during)["running"] == 1
    assert_idle(server)
    assert generated < max_tokens  # aborted, not run to the end


def test_64_concurrent_streams_match_solo_requests(server, client):
    prompts = [f"Story number {i}: once upon a time" for i in range(8)]
    solo = {
        p: client.completions.create(
            model=MODEL, prompt=p, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
        for p in prompts
    }

    async def one(s: aiohttp.ClientSession, p: str) -> tuple[str, str, int]:
        body = {"model": MODEL, "prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        async with s.post(server.base + "/v1/completions", json=body) as r:
            assert r.status == 200
            events = parse_sse(await r.read())
        assert events[-1] == "[DONE]"
        text = "".join(c["choices"][0]["text"] for c in events[:-1] if c["choices"])
        return p, text, events[-2]["usage"]["completion_tokens"]

    async def go() -> list[tuple[str, str, int]]:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as s:
            return await asyncio.gather(*(one(s, prompts[i % 8]) for i in range(64)))

    results = asyncio.run(go())
    assert len(results) == 64
    for p, text, ntok in results:
        assert text == solo[p], p
        assert ntok == 6
    assert_idle(server)


def bad_requests(limit: int) -> list[tuple[str, str, Any]]:
    """(path, description, body: dict | bytes) of malformed requests."""
    c, ch = "/v1/completions", "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    return [
        (c, "not json", b"{this is not json"),
        (c, "invalid utf-8", b'{"prompt": "\xff\xfe\xfa"}'),
        (c, "array body", b"[1, 2, 3]"),
        (c, "empty body", b""),
        (c, "NaN", b'{"prompt": "x", "temperature": NaN}'),
        (c, "lone surrogate", b'{"prompt": "\\ud800"}'),
        (c, "body over the size limit", b'{"prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}'),
        (c, "200 KiB prompt (tokenized off the loop), too long", {"prompt": "fox " * 50_000}),
        (c, "huge digit string", b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}"),
        (c, "deep nesting", b'{"prompt": ' + b"[" * 50000 + b"]" * 50000 + b"}"),
        (c, "ignored field of the wrong type", {"prompt": "x", "metadata": "tags"}),
        (c, "missing prompt", {"max_tokens": 3}),
        (c, "empty prompt", {"prompt": ""}),
        (c, "empty token list", {"prompt": []}),
        (c, "prompt of wrong type", {"prompt": {"text": "x"}}),
        (c, "token id out of vocab", {"prompt": [1, 2, 10**9]}),
        (c, "negative token id", {"prompt": [-3]}),
        (c, "prompt longer than max_model_len", {"prompt": [5] * limit}),
        (c, "prompt + max_tokens over max_model_len", {"prompt": [5] * 10, "max_tokens": limit}),
        (c, "huge max_tokens", {"prompt": "x", "max_tokens": 10**30}),
        (c, "max_tokens 0", {"prompt": "x", "max_tokens": 0}),
        (c, "max_tokens string", {"prompt": "x", "max_tokens": "10"}),
        (c, "max_tokens bool", {"prompt": "x", "max_tokens": True}),
        (c, "max_tokens float", {"prompt": "x", "max_tokens": 3.5}),
        (c, "huge temperature", {"prompt": "x", "temperature": 1e300}),
        (c, "negative temperature", {"prompt": "x", "temperature": -1}),
        (c, "top_p 0", {"prompt": "x", "top_p": 0}),
        (c, "top_k -5", {"prompt": "x", "top_k": -5}),
        (c, "n 0", {"prompt": "x", "n": 0}),
        (c, "n huge", {"prompt": "x", "n": 10**12}),
        (c, "n above the cap", {"prompt": "x", "n": 129}),
        (c, "seed below -2^63", {"prompt": "x", "seed": -(2**63) - 1}),
        (c, "seed over 2^63", {"prompt": "x", "seed": 2**63}),
        (c, "stop int", {"prompt": "x", "stop": 7}),
        (c, "stop list of ints", {"prompt": "x", "stop": [1, 2]}),
        (c, "stop empty string", {"prompt": "x", "stop": [""]}),
        (c, "logprobs over 20", {"prompt": "x", "logprobs": 50}),
        (c, "presence_penalty 9", {"prompt": "x", "presence_penalty": 9}),
        (c, "stream string", {"prompt": "x", "stream": "yes"}),
        (c, "stream_options without stream", {"prompt": "x", "stream_options": {"include_usage": True}}),
        (c, "min_tokens > max_tokens", {"prompt": "x", "min_tokens": 9, "max_tokens": 3}),
        (c, "wrong model", {"model": "gpt-4", "prompt": "x"}),
        (c, "logit_bias out of range", {"prompt": "x", "logit_bias": {"5": 100.5}}),
        (c, "return_token_ids not a bool", {"prompt": "x", "return_token_ids": 1}),
        (ch, "messages missing", {"max_tokens": 3}),
        (ch, "messages empty", {"messages": []}),
        (ch, "message not an object", {"messages": ["hi"]}),
        (ch, "bad role", {"messages": [{"role": "robot", "content": "x"}]}),
        (ch, "content int", {"messages": [{"role": "user", "content": 12}]}),
        (ch, "image part", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        (ch, "top_logprobs without logprobs", {"messages": msgs, "top_logprobs": 2}),
        (ch, "tools", {"messages": msgs, "tools": [{"type": "function", "function": {"name": "f"}}]}),
        (ch, "a vLLM field not implemented", {"messages": msgs, "chat_template": "{{ 1 }}"}),
        (ch, "chat too long", {"messages": [{"role": "user", "content": "fox " * (2 * limit)}]}),
        (ch, "chat return_token_ids not a bool", {"messages": msgs, "return_token_ids": "yes"}),
    ]


def test_bad_input_sweep(server, client):
    limit = max_model_len(client)
    before = wait_idle(server)
    cases = bad_requests(limit)
    assert len(cases) >= 30
    for path, what, body in cases:
        if isinstance(body, bytes):
            status, parsed, _ = post(server, path, data=body)
        else:
            status, parsed, _ = post(server, path, body)
        assert 400 <= status < 500, (what, status, parsed)
        assert isinstance(parsed, dict) and set(parsed) == {"error"}, (what, parsed)
        err = parsed["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str), (
            what,
            err,
        )
    after = wait_idle(server)
    # nothing reached the engine
    for name in ("hybridserve_prompt_tokens_total", "hybridserve_generation_tokens_total"):
        assert after[name] == before[name], name
    assert (
        after['hybridserve_http_errors_total{status="400"}']
        >= before.get('hybridserve_http_errors_total{status="400"}', 0) + 30
    )
    # and the server still serves a normal request
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert_idle(server)


def test_http_method_and_route_errors(server):
    async def go() -> list[tuple[int, Any]]:
        async with aiohttp.ClientSession() as s:
            out = []
            for method, path in (
                ("GET", "/v1/completions"),
                ("POST", "/v1/nothing"),
                ("DELETE", "/v1/models"),
            ):
                async with s.request(method, server.base + path) as r:
                    out.append((r.status, await r.json()))
            return out

    for status, body in asyncio.run(go()):
        assert status in (404, 405) and set(body["error"]) == {"message", "type", "param", "code"}


def test_a_client_that_stops_sending_its_body_gets_a_408(server, client):
    t0 = time.monotonic()
    head, body = raw_http(
        server,
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"pr',
        timeout=60,
    )
    assert time.monotonic() - t0 < 30  # the server's --body-read-timeout is 5 s
    assert head.startswith(b"HTTP/1.1 408"), head
    assert body["error"]["code"] == "request_timeout"
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0).choices


def test_a_body_not_in_its_content_encoding_is_a_400_and_an_unknown_coding_a_415(server, client):
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).encode()

    def post(enc: bytes) -> tuple[bytes, dict]:
        return raw_http(
            server,
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + b"Content-Encoding: "
            + enc
            + b"\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body,
        )

    for enc in (b"gzip", b"deflate"):
        head, parsed = post(enc)
        assert head.startswith(b"HTTP/1.1 400"), (enc, head)
        assert parsed["error"]["code"] == "bad_request_body"
    # a coding the server does not decode: refused, not read as plain JSON (the body here is
    # plain JSON, which must not run either)
    for enc in (b"foo", b"gzip, br", b"compress"):
        head, parsed = post(enc)
        assert head.startswith(b"HTTP/1.1 415"), (enc, head)
        assert parsed["error"]["code"] == "unsupported_media_type"
        assert enc.decode() in parsed["error"]["message"]
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0).choices
    assert "internal error" not in server.output()


def test_a_client_that_leaves_mid_body_is_no_internal_error(server, client):
    import socket

    def errors() -> dict[str, float]:
        m = metrics(server)
        return {
            s: m.get(f'hybridserve_http_errors_total{{status="{s}"}}', 0.0) for s in ("400", "499", "500")
        }

    before = errors()
    log_before = len(server.output())
    host, port = server.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"prompt":'
        )
        time.sleep(0.3)
    time.sleep(0.5)
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0).choices
    # nobody was answered: no error of any status is counted, and the access line says 499
    # (nginx's "client closed request"), not a client error of 400
    assert errors() == before
    log = server.output()[log_before:]
    assert '"POST /v1/completions" 499' in log and "code=client_gone" not in log, log
    assert "internal error" not in server.output() and "Traceback" not in server.output()


def test_a_client_that_leaves_as_its_stream_starts_is_no_internal_error(server, client):
    # a client that closes its connection about when the first chunk is written: aiohttp cancels
    # the handler on the next turn of its loop, but a write in between finds the transport
    # closing and raises. That is the client leaving (499), not an internal error (500). The
    # moment is a race, so many clients leave at spread-out moments around the first chunk.
    import random
    import socket
    import threading

    def errors() -> dict[str, float]:
        m = metrics(server)
        return {s: m.get(f'hybridserve_http_errors_total{{status="{s}"}}', 0.0) for s in ("499", "500")}

    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 5,
            "stream": True,
        }
    ).encode()
    raw = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )  # fmt: skip
    host, port = server.base.removeprefix("http://").split(":")
    rng = random.Random(0)

    def leave(delay: float) -> None:
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(raw)
            time.sleep(delay)

    before = errors()
    log_before = len(server.output())
    for _ in range(40):
        threads = [threading.Thread(target=leave, args=(rng.uniform(0, 0.02),)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    time.sleep(0.5)
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0).choices
    assert errors() == before
    log = server.output()[log_before:]
    assert "internal error" not in log and "Traceback" not in log, log
    assert " 500 " not in log, log


def test_a_client_that_never_finishes_its_headers_is_disconnected(server):
    # the server's --keep-alive-timeout is 8 s (the default is 15 s)
    t0 = time.monotonic()
    head, _ = raw_http(server, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n", timeout=60)
    assert head == b"" and 6 < time.monotonic() - t0 < 25


def test_malformed_http_gets_a_400_and_no_traceback_in_the_log(server, client):
    for raw in (
        b"GARBAGE\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\n\r\n",
    ):
        head, _ = raw_http(server, raw)
        assert head.startswith(b"HTTP/1.0 400"), (raw, head)
    # the server still serves, and logged no traceback for what its clients sent
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0).choices
    assert "Traceback" not in server.output() and "Error handling request" not in server.output()


def test_stop_string_length_limit_is_a_400_and_long_stop_strings_are_served(server, client):
    too_long = "x" * (MAX_STOP_STR_LEN + 1)
    for path, body in (
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "stop": [too_long]}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "stop": too_long}),
    ):
        status, parsed, _ = post(server, path, {"model": MODEL, **body})
        assert status == 400, (path, parsed)
        err = parsed["error"]
        assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", "stop", "invalid_value")
        assert f"at most {MAX_STOP_STR_LEN} characters" in err["message"], err["message"]
    # 15 stop strings at the limit next to a short one that occurs: the short one still cuts
    base = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0]
    assert len(base.text) >= 4
    stop = base.text[2:4]
    long_ones = [chr(0x4E00 + i) * MAX_STOP_STR_LEN for i in range(15)]
    for stream in (False, True):
        r = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[*long_ones, stop], stream=stream
        )
        chunks = list(r) if stream else [r]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        last = [c.choices[0] for c in chunks if c.choices][-1]
        assert text == base.text[: base.text.index(stop)]
        assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == stop
    assert_idle(server)


HUGE_PROMPT = "a b " * 900_000  # 3.6 MB: under the 4 MiB body limit; 1.8M tokens


def test_tokenize_counts_texts_past_the_context_up_to_its_limit(server):
    """/tokenize counts a text longer than the context (it does not generate), up to a limit (here
    its floor, 2**17 tokens): a text of megabytes, given or rendered from messages, is refused
    from its length alone, at once (its millions of ids and pieces took hundreds of megabytes per
    request, on a route without an API key), and a text just past the limit by its real count is
    refused with that count."""
    limit = P.tokenize_limit(256)
    assert limit == 1 << 17
    for field, value in (("prompt", HUGE_PROMPT), ("messages", [{"role": "user", "content": HUGE_PROMPT}])):
        t0 = time.monotonic()
        status, parsed, _ = post(server, "/tokenize", {"model": MODEL, field: value})
        assert time.monotonic() - t0 < 5.0
        err = parsed["error"]
        assert status == 400 and (err["param"], err["code"]) == (field, "invalid_value"), parsed
        assert "at least " in err["message"] and f"counts ({limit}:" in err["message"]
    # "a b " is two tokens: a text within the length bound, past the limit by its count
    text = "a b " * (limit // 2 + 10)
    status, parsed, _ = post(server, "/tokenize", {"model": MODEL, "prompt": text})
    assert status == 400 and "at least" not in parsed["error"]["message"], parsed
    chat = [{"role": "user", "content": text}]
    status, parsed, _ = post(server, "/tokenize", {"model": MODEL, "messages": chat})
    assert status == 400 and parsed["error"]["param"] == "messages", parsed
    status, parsed, _ = post(server, "/tokenize", {"model": MODEL, "prompt": "a b " * (limit // 2 - 10)})
    assert status == 200 and 256 < parsed["count"] <= limit, {k: parsed[k] for k in parsed if k != "tokens"}


def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing_it(server):
    """A prompt of megabytes is refused as longer than the context from its length alone (a
    byte-level BPE token stands for at most as many characters as its longest vocabulary entry),
    not after seconds of tokenizing: the message gives the bound, "at least" so many tokens."""
    limit = 256
    chat_prompt = [{"role": "user", "content": HUGE_PROMPT}]
    for path, body, param in (
        ("/v1/completions", {"prompt": HUGE_PROMPT, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": ["hi", HUGE_PROMPT], "max_tokens": 1}, "prompt"),
        ("/v1/chat/completions", {"messages": chat_prompt, "max_tokens": 1}, "messages"),
    ):
        status, parsed, _ = post(server, path, {"model": MODEL, **body})
        assert status == 400, (path, parsed)
        err = parsed["error"]
        assert (err["param"], err["code"]) == (param, "context_length_exceeded"), err
        assert "the prompt has at least " in err["message"] and f"length is {limit} tokens" in err["message"]
    # a prompt just past the context by its real count, within the bound, is counted exactly
    status, parsed, _ = post(
        server, "/v1/completions", {"model": MODEL, "prompt": "a b " * 200, "max_tokens": 1}
    )
    message = parsed["error"]["message"]
    assert status == 400 and "the prompt has " in message and "has at least" not in message, parsed
    assert_idle(server)
