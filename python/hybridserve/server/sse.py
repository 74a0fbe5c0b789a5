"""Server-Sent Events framing in the OpenAI style: `data: {json}\n\n` ... `data: [DONE]\n\n`."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import HttpVersion11, web

DONE = b"data: [DONE]\n\n"

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
    """An event stream whose writes give up after `write_timeout_s` seconds without the client
    taking what was sent (0: never). A client that stops reading would otherwise hold its request,
    its place in the server's queue and the connection until it hung up."""

    def __init__(self, request: web.Request, headers: dict[str, str], write_timeout_s: float) -> None:
        super().__init__(status=200, headers=headers)
        self.write_timeout_s = write_timeout_s
        self._transport = request.transport

    async def write_bounded(self, data: bytes | None) -> None:
        """Writes `data` (None: ends the stream). A client that has not read for the timeout
        raises ConnectionResetError, its connection dropped, as a client that hung up."""
        write = self.write_eof() if data is None else self.write(data)
        if self.write_timeout_s <= 0:
            await write
            return
        try:
            await asyncio.wait_for(write, self.write_timeout_s)
        except TimeoutError:
            if self._transport is not None:
                self._transport.abort()  # (what it holds unsent goes with it)
            raise ConnectionResetError(
                f"the client read nothing of the stream for {self.write_timeout_s:g} s"
            ) from None


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
