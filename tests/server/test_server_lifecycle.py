"""A second real server, with an API key, a queue of one and n-gram speculative decoding: /health
while loading, 401, multi-token streaming deltas and the spec-decode metrics, 503 + Retry-After on
a full queue, and a graceful SIGINT shutdown with a request in flight (503 and /health
"shutting_down" to new connections while it drains, the stream finished, exit 0)."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp
import openai
import pytest

from hybridserve.model.demo import ensure_demo_model
from server_fixtures import ServerProcess, parse_metrics, parse_sse, raw_http

MODEL = "served-demo"
KEY = "s3cret-key"


def test_auth_queue_limit_and_graceful_shutdown():
    ensure_demo_model()
    srv = ServerProcess(
        "--max-model-len", "2048", "--api-key", KEY, "--max-queue-len", "1", "--served-model-name", MODEL,
        "--shutdown-timeout", "120", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
    )  # fmt: skip
    try:
        srv.wait_ready()
        # listening started before the model was loaded: only 503 (loading) until the 200
        assert srv.health_seen[-1] == 200 and set(srv.health_seen[:-1]) == {503}
        _check_auth(srv)
        _check_speculative_stream(srv)
        asyncio.run(_check_queue_full_then_sigint(srv))
        assert srv.wait_exit(timeout=60) == 0, srv.output()[-3000:]
        assert srv.health_status() is None  # no longer listening
    finally:
        srv.stop()
    srv.remove_log()


def _check_auth(srv: ServerProcess) -> None:
    good = openai.OpenAI(base_url=srv.base + "/v1", api_key=KEY, max_retries=0, timeout=120)
    bad = openai.OpenAI(base_url=srv.base + "/v1", api_key="wrong", max_retries=0, timeout=120)
    r = good.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert r.model == MODEL and r.choices[0].text is not None
    with pytest.raises(openai.AuthenticationError) as ei:
        bad.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert ei.value.status_code == 401 and ei.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.NotFoundError):  # the served name, not the folder name
        good.completions.create(model="demo", prompt="Hello", max_tokens=2)
    assert srv.health_status() == 200  # /health needs no key
    # a key with a byte that is not UTF-8 is a wrong key (401), not a server error
    body = b'{"model": "%s", "prompt": "Hello", "max_tokens": 2}' % MODEL.encode()
    head, parsed = raw_http(
        srv,
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer s\xe9cret\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body,
        timeout=60,
    )
    assert head.startswith(b"HTTP/1.1 401"), head
    assert parsed["error"]["code"] == "invalid_api_key" and "internal error" not in srv.output()


def _check_speculative_stream(srv: ServerProcess) -> None:
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key=KEY, max_retries=0, timeout=120)
    prompt = "one two three one two three one two three one two"
    kw = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert full.usage.completion_tokens == 16
    m = parse_metrics(asyncio.run(_get_text(srv, "/metrics")))
    drafted = m["hybridserve_spec_decode_draft_tokens_total"]
    accepted = m["hybridserve_spec_decode_accepted_tokens_total"]
    assert drafted > 0 and 0 <= accepted <= drafted


async def _get_text(srv: ServerProcess, path: str) -> str:
    async with aiohttp.ClientSession() as s:
        async with s.get(srv.base + path) as r:
            assert r.status == 200
            return await r.text()


async def _check_queue_full_then_sigint(srv: ServerProcess) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    # long enough (hundreds of steps) to be still in flight while the drain is checked below
    long_body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession(headers=auth) as s:
        # a request whose body is still on its way when the drain begins: its route was entered
        # before (first of all here: the stream below must still run at the SIGINT), but it is not
        # admitted after (the drain has counted what is in flight)
        host, port = srv.base.removeprefix("http://").rsplit(":", 1)
        slow_reader, slow_writer = await asyncio.open_connection(host, int(port))
        slow_body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode()
        slow_writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: "
            + str(len(slow_body)).encode() + b"\r\n\r\n" + slow_body[:5]
        )  # fmt: skip
        await slow_writer.drain()
        await asyncio.sleep(0.5)  # the route has checked the server's state and waits for the body

        r = await s.post(srv.base + "/v1/completions", json=long_body)
        assert r.status == 200
        head = await r.content.readline() + await r.content.readline()  # one event: the request is in flight
        assert head.startswith(b"data: {")

        # the queue holds one request: a second one is refused with 503 + Retry-After
        async with s.post(
            srv.base + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}
        ) as r2:
            assert r2.status == 503
            assert int(r2.headers["Retry-After"]) >= 1
            err = (await r2.json())["error"]
            assert err["code"] == "queue_full" and set(err) == {"message", "type", "param", "code"}
            # the reason names the queue limit and what the engine can run at once
            assert "--max-queue-len) is 1" in err["message"] and "Mamba state pool" in err["message"]

        # SIGINT with the stream in flight: while it drains, the server still listens and a new
        # connection learns that it is shutting down (what a load balancer's health check needs)
        srv.signal(signal.SIGINT)
        async with aiohttp.ClientSession(headers=auth) as fresh:
            deadline = time.monotonic() + 15
            while True:
                async with fresh.get(srv.base + "/health") as h:
                    if h.status == 503:
                        assert (await h.json()) == {"status": "shutting_down"}
                        break
                assert time.monotonic() < deadline, "/health never said shutting_down"
                await asyncio.sleep(0.01)  # the signal may not have been handled yet
            async with fresh.post(
                srv.base + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}
            ) as r3:
                assert r3.status == 503 and (await r3.json())["error"]["code"] == "shutting_down"
                assert int(r3.headers["Retry-After"]) >= 1
        slow_writer.write(slow_body[5:])
        await slow_writer.drain()
        slow_answer = await asyncio.wait_for(slow_reader.read(), timeout=60)
        slow_writer.close()
        slow_head, _, slow_json = slow_answer.partition(b"\r\n\r\n")
        assert slow_head.startswith(b"HTTP/1.1 503"), slow_answer
        assert json.loads(slow_json)["error"]["code"] == "shutting_down", slow_answer
        # the in-flight stream finishes within the grace period, then the process exits 0
        rest = await r.content.read()
        events = parse_sse(head + rest)
        assert events[-1] == "[DONE]"
        last = events[-2]
        assert last["choices"][0]["finish_reason"] == "length"
        assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2])
        texts = [e["choices"][0]["text"] for e in events[:-1]]
        assert all(isinstance(t, str) for t in texts)
        r.release()
        json.dumps(events)  # well-formed JSON throughout


def test_a_body_still_arriving_does_not_hold_the_shutdown():
    """SIGTERM while a client sends its body a byte at a time: the request was never admitted,
    so the drain does not wait for it, and the process exits soon after --shutdown-timeout (it
    waited fifteen seconds more)."""
    ensure_demo_model()
    srv = ServerProcess("--shutdown-timeout", "1")
    try:
        srv.wait_ready()

        async def trickle_then_term() -> float:
            host, port = srv.base.removeprefix("http://").rsplit(":", 1)
            _, writer = await asyncio.open_connection(host, int(port))
            body = json.dumps({"model": "demo", "prompt": "x", "max_tokens": 2}).encode()
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:5]
            )
            await writer.drain()
            await asyncio.sleep(0.5)  # (the route waits for the rest of the body)
            start = time.monotonic()
            srv.signal(signal.SIGTERM)
            for byte in body[5:-1]:  # a byte a second, never the last
                await asyncio.sleep(1.0)
                if srv.proc.poll() is not None:
                    break
                try:
                    writer.write(bytes([byte]))
                    await writer.drain()
                except ConnectionError:  # (the server cut it)
                    pass
            writer.close()
            return time.monotonic() - start

        took = asyncio.run(trickle_then_term())
        assert srv.wait_exit(timeout=30) == 0, srv.output()[-3000:]
        assert took < 10, took
    finally:
        srv.stop()
    srv.remove_log()
