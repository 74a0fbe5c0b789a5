"""Server-Sent Events framing in the OpenAI style: `data: {json}\n\n` ... `data: [DONE]\n\n`."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

DONE = b"data: [DONE]\n\n"

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
    "X-Accel-Buffering": "no",
}


def encode_event(data: dict[str, Any]) -> bytes:
    """One SSE event. Compact JSON never holds a raw newline, so one `data:` line suffices."""
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


async def start_stream(request: web.Request, headers: dict[str, str] | None = None) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={**SSE_HEADERS, **(headers or {})})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    return resp


async def send_event(resp: web.StreamResponse, data: dict[str, Any]) -> None:
    await resp.write(encode_event(data))


async def send_done(resp: web.StreamResponse) -> None:
    await resp.write(DONE)


async def send_typed_event(resp: web.StreamResponse, data: dict[str, Any]) -> None:
    """One event of a Responses stream: its `type` also on an `event:` line, as OpenAI sends it."""
    await resp.write(b"event: " + str(data["type"]).encode("utf-8") + b"\n" + encode_event(data))
