"""A client that stops reading a streamed answer (docs/serving.md, "Slow readers"): after
--stream-write-timeout its request is aborted and its connection dropped, its place in the queue
is free again, and the server goes on answering others."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

from server_fixtures import assert_idle, call, get_metrics, running_server

INFLIGHT = "hybridserve_server_inflight_requests"


def open_stream(port: int, n: int, max_tokens: int, logprobs: int | None = 20) -> socket.socket:
    """A streamed completion of `n` choices with 20 logprobs per token (large chunks; None: a
    token's text alone), sent on a socket whose receive buffer holds a few KiB: the server's
    writes stop draining within a fraction of the answer unless it is read."""
    body = json.dumps(
        {"model": "demo", "prompt": "Once", "max_tokens": max_tokens, "n": n, "logprobs": logprobs,
         "ignore_eos": True, "stream": True}
    ).encode()  # fmt: skip
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    )  # fmt: skip
    return sock


def test_a_client_that_reads_nothing_is_cut_off_after_the_write_timeout() -> None:
    with running_server("--stream-write-timeout", "2", "--max-queue-len", "8") as server:
        sock = open_stream(server.port, 8, 1500)
        try:
            _wait_admitted(server, 8)
            # a full queue meanwhile: the silent client holds all 8 places
            status, err = call(server, "/v1/completions", {"model": "demo", "prompt": "x", "max_tokens": 2})
            assert status == 503 and err["error"]["code"] == "queue_full"
            _assert_cut_off(server, sock)
        finally:
            sock.close()
        status, out = call(server, "/v1/completions", {"model": "demo", "prompt": "x", "max_tokens": 2})
        assert status == 200 and out["usage"]["completion_tokens"] == 2
        _a_slow_reader_keeps_its_stream(server.port)
        _small_chunks_are_cut_off_too(server)
        assert_idle(server)


def _small_chunks_are_cut_off_too(server: Any) -> None:
    """Chunks of a token's text each, and few of them: the whole answer (under 2 MB) fits the
    kernel's send queue, so no write ever waits (the answer ran to its end); what the client
    takes stops moving once its receive buffer is full, and that is what the timeout counts. A
    request of 6 choices read as usual beside it makes the steps slower, so that the silent
    stream outlasts the timeout."""
    answers: list[tuple[int, Any]] = []
    body = {"model": "demo", "prompt": "Once", "max_tokens": 4000, "n": 6, "ignore_eos": True}
    beside = threading.Thread(target=lambda: answers.append(call(server, "/v1/completions", body)))
    beside.start()
    sock = open_stream(server.port, 2, 4000, logprobs=None)
    try:
        _wait_admitted(server, 8)
        _assert_cut_off(server, sock)
    finally:
        sock.close()
        beside.join(timeout=120)
    assert [status for status, _ in answers] == [200]


def _wait_admitted(server: Any, n: int) -> None:
    deadline = time.monotonic() + 60
    while get_metrics(server)[INFLIGHT] < n:
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.05)


def _assert_cut_off(server: Any, sock: socket.socket) -> None:
    """The silent client's request ends (within a minute) and its connection is dropped: what it
    had buffered, then its end, without the answer's."""
    t0 = time.monotonic()
    while get_metrics(server)[INFLIGHT] > 0:
        assert time.monotonic() - t0 < 60, "the silent client's request was never cut off"
        time.sleep(0.1)
    sock.settimeout(30)
    received = b""
    try:
        while chunk := sock.recv(1 << 16):
            received += chunk
    except ConnectionResetError:
        pass
    assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received


def _a_slow_reader_keeps_its_stream(port: int) -> None:
    """A client that reads slowly but steadily, for several times the write timeout, is not cut
    off: the timeout counts time in which it took nothing."""
    sock = open_stream(port, 2, 800)
    sock.settimeout(30)
    received = b""
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 5:  # 2.5 timeouts, a few KiB every 0.2 s
            received += sock.recv(4096)
            time.sleep(0.2)
        while chunk := sock.recv(1 << 20):  # then the rest at full speed
            received += chunk
            if received.endswith(b"data: [DONE]\n\n0\r\n\r\n"):
                break
    finally:
        sock.close()
    assert b"data: [DONE]" in received, received[-300:]
