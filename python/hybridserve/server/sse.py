"""Server-Sent Events framing in the OpenAI style: `data: {json}\n\n` ... `data: [DONE]\n\n`."""

from __future__ import annotations

import asyncio
import fcntl
import json
import socket
import struct
import sys
import termios
from typing import Any

from aiohttp import HttpVersion11, web

DONE = b"data: [DONE]\n\n"
_TIOCOUTQ: int | None = getattr(termios, "TIOCOUTQ", None)
# (the offset below is Linux's struct tcp_info: other systems lay theirs out otherwise)
_TCP_INFO: int | None = getattr(socket, "TCP_INFO", None) if sys.platform.startswith("linux") else None
# where `tcpi_bytes_acked` (a u64) ends in Linux's struct tcp_info (since Linux 4.1)
_BYTES_ACKED_END = 128

# (no Connection header: whether the connection stays open is the HTTP layer's to say, and a
# client that asked for `Connection: close` must not be told otherwise)
SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


def encode_event(data: dict[str, Any]) -> bytes:
    """One SSE event. Compact JSON never holds a raw newline, so one `data:` line suffices."""
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


class EventStream(web.StreamResponse):
    """An event stream that gives up on a client that takes nothing of it for `write_timeout_s`
    seconds (0: never): with bytes of the stream unsent all that time and none more of them
    taken, the connection is dropped, and the next write raises ConnectionResetError, as for a
    client that hung up. A client that stopped reading would otherwise hold its request, its
    place in the server's queue and the connection until it hung up; one that reads slowly keeps
    its stream. A watchdog looks about once a second while bytes are unsent and the stream has
    not ended (`_took_some`): over TCP on Linux a client that reads nothing is seen as soon as
    its own receive buffer is full, not only once the kernel's send queue (up to megabytes) and
    the transport's buffer are too."""

    def __init__(self, request: web.Request, headers: dict[str, str], write_timeout_s: float) -> None:
        super().__init__(status=200, headers=headers)
        self.write_timeout_s = write_timeout_s
        self.timed_out = False
        self._transport = request.transport
        self._watchdog: asyncio.TimerHandle | None = None
        self._stalled_since = 0.0
        self._progress = 0  # what `_took_some` last saw

    async def write_bounded(self, data: bytes | None) -> None:
        """Writes `data` (None: ends the stream)."""
        if self.timed_out:
            raise self._timed_out()
        if self.write_timeout_s > 0 and self._watchdog is None and self._transport is not None:
            loop = asyncio.get_running_loop()
            self._stalled_since = loop.time()
            self._took_some()  # (what was taken so far is the start)
            self._watchdog = loop.call_later(min(1.0, self.write_timeout_s), self._watch)
        await (self.write_eof() if data is None else self.write(data))
        if self.timed_out:  # (the dropped connection lets a waiting write return)
            raise self._timed_out()

    def _unsent(self) -> int:
        """Bytes of the stream not yet taken by the client: the transport's buffer and, on Linux,
        the socket's send queue (TIOCOUTQ: sent and not acknowledged, or not sent). The transport's
        buffer alone can stand still for seconds while the client reads: the kernel takes more of
        it only once much of its own queue has gone."""
        assert self._transport is not None
        n = self._transport.get_write_buffer_size()
        sock = self._transport.get_extra_info("socket")
        if sock is not None and _TIOCOUTQ is not None:
            try:
                n += struct.unpack("i", fcntl.ioctl(sock.fileno(), _TIOCOUTQ, b"\0\0\0\0"))[0]
            except OSError:
                pass
        return n

    def _acked(self) -> int | None:
        """The bytes the client's end of the connection has acknowledged (Linux's TCP_INFO
        `tcpi_bytes_acked`, whatever they hold: headers, chunk framing, TLS records), a count
        that grows exactly while the client takes the stream; None where there is none (a Unix
        socket, another system)."""
        assert self._transport is not None
        sock = self._transport.get_extra_info("socket")
        if sock is None or _TCP_INFO is None:
            return None
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 256)
        except OSError:
            return None
        if len(info) < _BYTES_ACKED_END:  # (Linux before 4.1)
            return None
        return int(struct.unpack_from("Q", info, _BYTES_ACKED_END - 8)[0])

    def _took_some(self) -> bool:
        """Whether the client took bytes of the stream since the last look. Without TCP's count
        (`_acked`) only the transport's own buffer, which counts bytes exactly, is read: it holds
        any only once the kernel's queue is full, and while it is empty nothing says the client
        stopped (a Unix socket's queue counts the kernel's memory, not bytes), and a drop of it
        is a take (writes only add to it)."""
        acked = self._acked()
        if acked is None:
            assert self._transport is not None
            acked = -self._transport.get_write_buffer_size()  # (a drop is a take)
            if acked == 0:
                self._progress = 0
                return True
        took, self._progress = acked > self._progress, acked
        return took

    def _watch(self) -> None:
        self._watchdog = None
        transport = self._transport
        # (once the stream has ended the connection may carry the next request's answer: its
        # bytes are not this stream's to judge)
        if transport is None or transport.is_closing() or self._eof_sent:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._unsent() == 0:
            return  # all taken (armed again by the next write)
        if self._took_some():
            self._stalled_since = now
        if now - self._stalled_since >= self.write_timeout_s:
            self.timed_out = True
            transport.abort()  # (what it holds unsent goes with it)
            return
        self._watchdog = loop.call_later(min(1.0, self.write_timeout_s), self._watch)

    def _timed_out(self) -> ConnectionResetError:
        return ConnectionResetError(f"the client took nothing of the stream for {self.write_timeout_s:g} s")


async def start_stream(
    request: web.Request, headers: dict[str, str] | None = None, write_timeout_s: float = 0.0
) -> EventStream:
    resp = EventStream(request, {**SSE_HEADERS, **(headers or {})}, write_timeout_s)
    if request.version >= HttpVersion11:
        resp.enable_chunked_encoding()
    else:
        # HTTP/1.0 has no chunks (proxies that forward as 1.0 are common): the stream has no
        # length and ends when the server closes the connection
        resp.force_close()
    await resp.prepare(request)
    return resp


async def send_event(resp: EventStream, data: dict[str, Any]) -> None:
    await resp.write_bounded(encode_event(data))


async def send_done(resp: EventStream) -> None:
    await resp.write_bounded(DONE)


async def end_stream(resp: EventStream) -> None:
    await resp.write_bounded(None)


async def send_typed_event(resp: EventStream, data: dict[str, Any]) -> None:
    """One event of a Responses stream: its `type` also on an `event:` line, as OpenAI sends it."""
    await resp.write_bounded(b"event: " + str(data["type"]).encode("utf-8") + b"\n" + encode_event(data))
