"""Server-Sent Events framing in the OpenAI style: `data: {json}\n\n` ... `data: [DONE]\n\n`."""

from __future__ import annotations

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


async def start_stream(request: web.Request, headers: dict[str, str] | None = None) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={**SSE_HEADERS, **(headers or {})})
    if request.version >= HttpVersion11:
        resp.enable_chunked_encoding()
    else:
        # HTTP/1.0 has no chunks (proxies that forward as 1.0 are common): the stream has no
        # length and ends when the server closes the connection
        resp.force_close()
    await resp.prepare(request)
    return resp


async def send_event(resp: web.StreamResponse, data: dict[str, Any]) -> None:
    await resp.write(encode_event(data))


async def send_done(resp: web.StreamResponse) -> None:
    await resp.write(DONE)


async def send_typed_event(resp: web.StreamResponse, data: dict[str, Any]) -> None:
    """One event of a Responses stream: its `type` also on an `event:` line, as OpenAI sends it."""
    await resp.write(b"event: " + str(data["type"]).encode("utf-8") + b"\n" + encode_event(data))
