"""`--uds PATH`: the server listens on a Unix domain socket instead of TCP. Requests reach it
there (plain HTTP from http.client, a stream through aiohttp's Unix connector, HTTPS with
`--ssl-*`), the TCP port stays closed, the socket file goes when the server stops, a stale one
is replaced, and a path that holds another file or a live server's socket stops the server."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import trustme

from hybridserve.model.demo import ensure_demo_model
from server_fixtures import ROOT, ServerProcess, parse_sse, running_server, unix_http


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # (a Unix socket path is at most 107 bytes: pytest's tmp_path can be longer)
    d = Path(tempfile.mkdtemp(prefix="hs-uds-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _stream(path: str, body: dict[str, object]) -> list[object]:
    async def run() -> bytes:
        conn = aiohttp.UnixConnector(path=path)
        async with aiohttp.ClientSession(connector=conn) as s:
            async with s.post("http://localhost/v1/completions", json=body) as r:
                assert r.status == 200
                return await r.read()

    return parse_sse(asyncio.run(run()))


def test_requests_reach_the_server_on_its_socket_and_the_socket_goes_with_it(sock_dir: Path) -> None:
    path = str(sock_dir / "hs.sock")
    body = {"prompt": "Hello", "max_tokens": 6, "temperature": 0}
    with running_server("--max-num-seqs", "4", uds=path) as srv:
        status, raw = unix_http(path, "POST", "/v1/completions", body)
        assert status == 200
        whole = json.loads(raw)["choices"][0]["text"]
        events = _stream(path, {**body, "stream": True})
        assert events[-1] == "[DONE]"
        assert "".join(e["choices"][0]["text"] for e in events[:-1] if isinstance(e, dict)) == whole
        assert unix_http(path, "GET", "/v1/models")[0] == 200
        # a proxy may forward its clients' Host: no page can reach a Unix socket (no rebinding)
        assert unix_http(path, "GET", "/v1/models", host="api.example.com")[0] == 200
        with pytest.raises(ConnectionRefusedError):  # nothing on the TCP port
            socket.create_connection(("127.0.0.1", srv.port), timeout=5).close()
        assert f"listening on http+unix:{path}" in srv.output()
    assert not os.path.exists(path)


def test_https_on_the_socket(sock_dir: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("localhost")
    cert_file, key_file = str(sock_dir / "cert.pem"), str(sock_dir / "key.pem")
    cert.cert_chain_pems[0].write_to_path(cert_file)
    cert.private_key_pem.write_to_path(key_file)
    client = ssl.create_default_context()
    ca.configure_trust(client)
    path = str(sock_dir / "hs.sock")
    with running_server("--ssl-certfile", cert_file, "--ssl-keyfile", key_file, uds=path, tls=client):
        body = {"prompt": "Hello", "max_tokens": 3, "stream": True}
        status, raw = unix_http(path, "POST", "/v1/completions", body, tls=client)
        assert status == 200 and parse_sse(raw)[-1] == "[DONE]"
        with pytest.raises(OSError):  # plain HTTP on the socket gets no answer
            unix_http(path, "POST", "/v1/completions", body, timeout=10)


def test_a_stale_socket_file_is_replaced(sock_dir: Path) -> None:
    path = str(sock_dir / "hs.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)  # a socket file nobody listens on, as a killed server leaves it
    stale.close()
    with running_server(uds=path):
        assert unix_http(path, "GET", "/health")[0] == 200


def _serve_exits(path: str) -> subprocess.CompletedProcess[str]:
    ensure_demo_model()
    argv = [sys.executable, "-m", "hybridserve", "serve", "demo", "--uds", path]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)


def test_a_path_that_holds_a_file_or_a_live_server_stops_the_server(sock_dir: Path) -> None:
    path = sock_dir / "not-a-socket"
    path.write_text("keep me")
    done = _serve_exits(str(path))
    assert done.returncode == 1 and "exists and is not a socket" in done.stderr, done.stderr[-2000:]
    assert path.read_text() == "keep me"
    live = str(sock_dir / "hs.sock")
    with running_server(uds=live) as first:
        done = _serve_exits(live)
        assert done.returncode == 1 and "another server listens" in done.stderr, done.stderr[-2000:]
        assert isinstance(first, ServerProcess) and unix_http(live, "GET", "/health")[0] == 200
