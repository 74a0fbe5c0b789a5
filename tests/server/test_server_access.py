"""The Host and Origin checks (server/access.py) and JSON-only bodies, against a real
`hybridserve serve demo` on 127.0.0.1 with one allowed origin and one extra Host name: a request a
web page on another site makes through a browser (by `Origin`, or `Sec-Fetch-Site` when there is
no Origin), one through a name that is not the server's (DNS rebinding) and a body without a
Content-Type are refused with an OpenAI-style 403 / 415 that is counted in
hybridserve_http_errors_total, before anything reaches the engine; clients that are not browsers
(no Origin, no Sec-Fetch-Site) and the localhost names are served as before."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest

from hybridserve.model.demo import ensure_demo_model
from hybridserve.server.access import AccessPolicy, parse_allowed_hosts, parse_allowed_origins
from hybridserve.server.app import create_app
from server_fixtures import ServerProcess, parse_metrics, raw_http, running_server

MODEL = "demo"
ALLOWED_ORIGIN = "http://localhost:3000"
ALLOWED_HOST = "api.example.test"
BODY = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    ensure_demo_model()
    with running_server(
        "--max-model-len", "256", "--allowed-origins", ALLOWED_ORIGIN, "--allowed-hosts", ALLOWED_HOST
    ) as srv:
        yield srv


def call(
    server: ServerProcess,
    method: str,
    path: str,
    headers: dict[str, str] | None = None,
    body: Any = BODY,
) -> tuple[int, Any, dict[str, str]]:
    """One request by aiohttp (which sends neither Origin nor Sec-Fetch-Site by itself); a given
    Host header replaces the one aiohttp would send. `body` is sent as JSON on a POST."""

    async def go() -> tuple[int, Any, dict[str, str]]:
        h = dict(headers or {})
        data = None
        if method == "POST":
            data = json.dumps(body).encode()
            h.setdefault("Content-Type", "application/json")
        async with aiohttp.ClientSession() as s:
            async with s.request(method, server.base + path, data=data, headers=h) as r:
                raw = await r.read()
                try:
                    parsed: Any = json.loads(raw)
                except ValueError:
                    parsed = raw
                return r.status, parsed, dict(r.headers)

    return asyncio.run(go())


def metrics(server: ServerProcess) -> dict[str, float]:
    status, raw, _ = call(server, "GET", "/metrics")
    assert status == 200
    return parse_metrics(raw.decode())


def refused_count(m: dict[str, float], status: int) -> float:
    return m.get(f'hybridserve_http_errors_total{{status="{status}"}}', 0.0)


def engine_work(m: dict[str, float]) -> tuple[float, float]:
    """(prompt tokens the engine processed, engine requests finished): what a request that
    reached the engine moves."""
    finished = sum(v for k, v in m.items() if k.startswith("hybridserve_requests_finished_total"))
    return m["hybridserve_prompt_tokens_total"], finished


def assert_openai_error(body: Any, code: str) -> None:
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == code and body["error"]["type"] == "invalid_request_error", body


def test_pages_of_other_sites_are_refused_before_the_engine(server: ServerProcess) -> None:
    before = metrics(server)
    own = f"http://127.0.0.1:{server.port}"
    attempts = [
        ("POST", "/v1/completions", {"Origin": "https://evil.example"}),
        ("POST", "/v1/chat/completions", {"Origin": "https://evil.example"}),
        # another port of this machine is another application (same-site, not same-origin)
        ("POST", "/v1/completions", {"Origin": f"http://127.0.0.1:{server.port + 1}"}),
        # sandboxed frames and local files send "null"
        ("POST", "/v1/completions", {"Origin": "null"}),
        # the allowed origin on another port or scheme is another origin
        ("POST", "/v1/completions", {"Origin": "http://localhost:3001"}),
        ("POST", "/v1/completions", {"Origin": "https://localhost:3000"}),
        # a form post says text/plain: refused for its origin already
        ("POST", "/v1/completions", {"Origin": "https://evil.example", "Content-Type": "text/plain"}),
        ("GET", "/v1/models", {"Origin": "https://evil.example"}),
        # no Origin: Sec-Fetch-Site tells (e.g. an <img> or a link another site's page holds)
        ("POST", "/v1/completions", {"Sec-Fetch-Site": "cross-site"}),
        ("GET", "/v1/models", {"Sec-Fetch-Site": "cross-site"}),
        ("GET", "/metrics", {"Sec-Fetch-Site": "same-site"}),
        # a CORS preflight from a site that is not allowed
        ("OPTIONS", "/v1/completions", {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}),
    ]  # fmt: skip
    for method, path, headers in attempts:
        status, body, resp_headers = call(server, method, path, headers)
        assert status == 403, (method, path, headers, body)
        assert_openai_error(body, "origin_not_allowed")
        assert "--allowed-origins" in body["error"]["message"]
        assert "Access-Control-Allow-Origin" not in resp_headers
    after = metrics(server)
    assert refused_count(after, 403) - refused_count(before, 403) == len(attempts)
    assert engine_work(after) == engine_work(before)
    # the server's own origin, reached through a name the Host check accepts, is not another site
    status, body, _ = call(server, "POST", "/v1/completions", {"Origin": own})
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body
    for site in ("same-origin", "none"):  # "none": the user typed the address
        status, body, _ = call(server, "GET", "/v1/models", {"Sec-Fetch-Site": site})
        assert status == 200 and body["data"][0]["id"] == MODEL, (site, body)


def test_an_allowed_origin_is_served_and_may_read_the_answers(server: ServerProcess) -> None:
    origin = {"Origin": ALLOWED_ORIGIN}
    status, body, headers = call(server, "POST", "/v1/completions", origin)
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body
    assert headers["Access-Control-Allow-Origin"] == ALLOWED_ORIGIN and "Origin" in headers["Vary"]
    # the page may read the answer's id and when to retry
    assert set(headers["Access-Control-Expose-Headers"].split(", ")) == {"Retry-After", "X-Request-Id"}
    assert {k.lower(): v for k, v in headers.items()}["x-request-id"].startswith("cmpl-")
    # Origin decides over Sec-Fetch-Site: the allowed origin is another site, and allowed
    status, body, headers = call(
        server, "POST", "/v1/completions", {**origin, "Sec-Fetch-Site": "cross-site"}
    )
    assert status == 200 and headers["Access-Control-Allow-Origin"] == ALLOWED_ORIGIN
    # a streamed answer gets the header too (it is set as the response starts, not by a handler)
    status, raw, headers = call(server, "POST", "/v1/chat/completions", origin, body={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True,
    })  # fmt: skip
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
    assert headers["Access-Control-Allow-Origin"] == ALLOWED_ORIGIN
    # and so does an error, so the page can show it
    status, body, headers = call(server, "POST", "/v1/completions", origin, body={**BODY, "n": 0})
    assert status == 400 and headers["Access-Control-Allow-Origin"] == ALLOWED_ORIGIN
    # the preflight a JSON POST needs, with the headers the openai library sends from a browser
    status, _, headers = call(server, "OPTIONS", "/v1/chat/completions", {
        **origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type,x-stainless-os",
    })  # fmt: skip
    assert status == 204, headers
    assert headers["Access-Control-Allow-Origin"] == ALLOWED_ORIGIN
    assert set(headers["Access-Control-Allow-Methods"].split(", ")) == {"GET", "POST", "DELETE"}
    assert headers["Access-Control-Allow-Headers"] == "authorization,content-type,x-stainless-os"
    # an OPTIONS that is no preflight is still a method the route does not have
    status, body, _ = call(server, "OPTIONS", "/v1/completions")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"
    # clients that are not browsers send no Origin: no CORS headers, served as always
    status, body, headers = call(server, "POST", "/v1/completions")
    assert status == 200 and "Access-Control-Allow-Origin" not in headers


def test_a_host_that_is_not_the_servers_is_refused(server: ServerProcess) -> None:
    before = metrics(server)
    # DNS rebinding: the attacker's name now points at 127.0.0.1; the page is same-origin with
    # the server under that name, so its Origin matches the Host: the Host check refuses it
    rebound = f"rebind.evil.example:{server.port}"
    attempts = [
        ("POST", "/v1/completions", {"Host": rebound, "Origin": f"http://{rebound}"}),
        ("GET", "/v1/models", {"Host": rebound}),
        ("GET", "/metrics", {"Host": rebound}),
        ("POST", "/v1/completions", {"Host": "x"}),
        ("POST", "/v1/completions", {"Host": f"localhost.evil.example:{server.port}"}),
    ]
    for method, path, headers in attempts:
        status, body, _ = call(server, method, path, headers)
        assert status == 403, (method, path, headers, body)
        assert_openai_error(body, "host_not_allowed")
        assert "--allowed-hosts" in body["error"]["message"]
    after = metrics(server)
    assert refused_count(after, 403) - refused_count(before, 403) == len(attempts)
    assert engine_work(after) == engine_work(before)
    # /health too (a probe through a foreign name learns nothing), though /health is not counted
    status, body, _ = call(server, "GET", "/health", {"Host": rebound})
    assert status == 403 and body["error"]["code"] == "host_not_allowed"


def test_localhost_names_and_allowed_hosts_are_accepted(server: ServerProcess) -> None:
    p = server.port
    for host in (
        f"127.0.0.1:{p}",
        f"localhost:{p}",
        f"[::1]:{p}",
        "localhost",
        "LocalHost.",
        f"{ALLOWED_HOST}:{p}",
    ):
        status, body, _ = call(server, "GET", "/v1/models", {"Host": host})
        assert status == 200 and body["data"][0]["id"] == MODEL, (host, body)
    status, body, _ = call(server, "POST", "/v1/completions", {"Host": f"localhost:{p}"})
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body
    # the openai client (httpx) sends the Host of base_url
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
        assert r.usage is not None and r.usage.completion_tokens == 2
    finally:
        client.close()


def test_a_body_without_content_type_is_refused(server: ServerProcess) -> None:
    before = metrics(server)
    payload = json.dumps(BODY).encode()
    head, parsed = raw_http(
        server,
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: "
        + str(len(payload)).encode()
        + b"\r\n\r\n"
        + payload,
    )
    assert head.startswith(b"HTTP/1.1 415"), head
    assert_openai_error(parsed, "unsupported_media_type")
    # application/json with a charset is fine
    status, body, _ = call(
        server, "POST", "/v1/completions", {"Content-Type": "application/json; charset=utf-8"}
    )
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    after = metrics(server)
    assert refused_count(after, 415) - refused_count(before, 415) == 1


# ---------------------------------------------------------------------- without a real server


async def test_bound_to_all_interfaces_the_host_is_not_checked_but_origins_are(aiohttp_client: Any) -> None:
    client = await aiohttp_client(
        create_app(None, served_model_name=MODEL, access=AccessPolicy.for_bind("0.0.0.0"))
    )
    r = await client.get("/v1/models", headers={"Host": "gpu-box.internal:8000"})
    assert r.status == 200
    # without a Host check an Origin equal to the Host proves nothing (DNS rebinding): refused
    r = await client.get(
        "/v1/models", headers={"Host": "evil.example:8000", "Origin": "http://evil.example:8000"}
    )
    assert r.status == 403 and (await r.json())["error"]["code"] == "origin_not_allowed"
    r = await client.get("/metrics")
    assert 'hybridserve_http_errors_total{status="403"} 1.0' in await r.text()


def test_the_policy_of_each_bind_address() -> None:
    assert AccessPolicy.for_bind("0.0.0.0").allowed_hosts is None
    assert AccessPolicy.for_bind("::").allowed_hosts is None
    assert AccessPolicy.for_bind(None).allowed_hosts is None  # an app not started by the CLI
    assert AccessPolicy.for_bind("127.0.0.1").allowed_hosts == {"localhost", "127.0.0.1", "::1"}
    assert AccessPolicy.for_bind("::1").allowed_hosts == {"localhost", "127.0.0.1", "::1"}
    assert AccessPolicy.for_bind("10.1.2.3").allowed_hosts == {"localhost", "127.0.0.1", "::1", "10.1.2.3"}
    # bound to all interfaces, --allowed-hosts turns the check on (localhost names stay accepted)
    assert AccessPolicy.for_bind("0.0.0.0", ["api.example.com"]).allowed_hosts == {
        "localhost", "127.0.0.1", "::1", "api.example.com"
    }  # fmt: skip
    assert AccessPolicy.for_bind("127.0.0.1", ["*"]).allowed_hosts is None
    star = AccessPolicy.for_bind("127.0.0.1", (), ["*"])
    assert star.any_origin and star.refusal({"Host": "localhost", "Origin": "https://any.example"}) is None
    assert star.refusal({"Host": "evil.example"}) is not None  # '*' origins keep the Host check


def test_the_flags_are_checked_and_normalised() -> None:
    assert parse_allowed_origins("http://LocalHost:3000/, https://app.example:443,*") == (
        "http://localhost:3000",
        "https://app.example",
        "*",
    )
    assert parse_allowed_hosts("API.example.com., [::1], 10.0.0.1") == ("api.example.com", "::1", "10.0.0.1")
    for bad in ("null", "localhost:3000", "http://a.example/path", "ftp://a.example", "http://a:99999", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_allowed_origins(bad)
    for bad in ("http://a.example", "a.example:8000", "a,,b", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_allowed_hosts(bad)


@pytest.mark.parametrize(
    ("flag", "value"), [("--allowed-origins", "null"), ("--allowed-hosts", "api.example.com:80")]
)
def test_serve_refuses_a_bad_flag_in_one_line(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from hybridserve.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "demo", flag, value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and flag in err and "Traceback" not in err
