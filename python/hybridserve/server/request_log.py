"""What the server tells its operator (docs/serving.md, section 'Logging'): one access line per
request (`--no-access-log` turns it off), and while the engine has work a line every
`--log-stats-interval` seconds with its queues, token rates, prefix-cache hit rate and cache usage,
as vLLM prints them (`--disable-log-stats` turns it off). With `--enable-log-requests`, a line per
generation request with its prompt and sampling parameters (as vLLM's flag; off by default, since
prompts are the users' data).

Everything a client controls (paths, field names, error messages that quote the request) is
written escaped and cut short, so that a request cannot forge or flood log lines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from hybridserve.sampling.params import SamplingParams
from hybridserve.server.metrics import engine_value

ACCESS_LOGGER = logging.getLogger("hybridserve.access")
STATS_LOGGER = logging.getLogger("hybridserve.stats")
REQUESTS_LOGGER = logging.getLogger("hybridserve.requests")

# Probed every few seconds by load balancers, orchestrators and Prometheus: their lines are at
# debug level, so that the access log shows the requests that do work.
QUIET_PATHS = frozenset({"/health", "/ping", "/metrics"})
# A client that goes away before its answer is complete (nginx's code for it).
CLIENT_CLOSED = 499
RECORD_KEY = "hybridserve_record"  # the generation handlers' RequestRecord, on the aiohttp request
REQUEST_ID_KEY = "hybridserve_request_id"  # a generation request's answer id, on the aiohttp request
# the client's X-Request-Id where the answer's id is not made of it (a Responses answer)
CLIENT_REQUEST_ID_KEY = "hybridserve_client_request_id"


def printable(text: str, limit: int = 200) -> str:
    """`text` with every non-printable character escaped, cut to `limit` characters: a value a
    client chose cannot start a new log line or hide in control characters."""
    if len(text) > limit:
        text = text[:limit] + "..."
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode() for c in text
    )


_DEFAULT_PARAMS = SamplingParams()


def request_line(
    request_id: str, prompt_text: str | None, prompt_ids: list[int], params: Any, max_len: int | None
) -> str:
    """The `--enable-log-requests` line of one prompt of a request: its id, the prompt (its text
    when the client sent text, else its token ids; the first `max_len` characters or ids when
    given, `--max-log-len`), how many tokens it has, and the sampling parameters that differ
    from their defaults."""
    if prompt_text is not None:
        cut = prompt_text if max_len is None else prompt_text[:max_len]
        # (repr escapes every character that is not printable: a prompt cannot forge a line)
        shown = repr(cut) + ("..." if len(cut) < len(prompt_text) else "")
    else:
        ids = prompt_ids if max_len is None else prompt_ids[:max_len]
        shown = str(ids)[:-1] + (", ...]" if len(ids) < len(prompt_ids) else "]")
    default = _DEFAULT_PARAMS
    changed = [
        f"{f.name}={printable(repr(getattr(params, f.name)))}"
        for f in dataclasses.fields(params)
        if getattr(params, f.name) != getattr(default, f.name)
    ]
    return (
        f"request {printable(request_id)}: prompt {shown} ({len(prompt_ids)} tokens), "
        f"params: {', '.join(changed) or 'defaults'}"
    )


def output_line(
    request_id: str,
    index: int,
    text: str,
    token_ids: list[int],
    finish_reason: str | None,
    max_len: int | None,
) -> str:
    """The `--enable-log-outputs` line of one finished choice: the answer's id and the choice's
    index, its text (the first `max_len` characters when given, `--max-log-len`), how many
    tokens it has, and why it ended."""
    cut = text if max_len is None else text[:max_len]
    shown = repr(cut) + ("..." if len(cut) < len(text) else "")
    return (
        f"output {printable(request_id)} choice {index}: {shown} ({len(token_ids)} tokens), "
        f"finish_reason={finish_reason}"
    )


@dataclass
class RequestRecord:
    """What a generation handler reports of its request for the access line."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None  # to the first token of any choice


def access_line(request: web.BaseRequest, status: int, elapsed_s: float) -> str:
    record = request.get(RECORD_KEY)
    parts = [f'{request.remote or "-"} "{request.method} {printable(request.raw_path)}" {status}']
    if isinstance(record, RequestRecord):
        ttft = f"{record.ttft_s:.3f}s" if record.ttft_s is not None else "-"
        parts.append(
            f"prompt_tokens={record.prompt_tokens} output_tokens={record.output_tokens} "
            f"cached_tokens={record.cached_tokens} ttft={ttft}"
        )
    parts.append(f"e2e={elapsed_s:.3f}s")
    request_id = request.get(REQUEST_ID_KEY)
    if isinstance(request_id, str):
        parts.append(f"id={printable(request_id, 300)}")
    client_id = request.get(CLIENT_REQUEST_ID_KEY)
    if isinstance(client_id, str):
        parts.append(f"x_request_id={printable(client_id, 300)}")
    return " ".join(parts)


def _log_access(request: web.BaseRequest, status: int, start: float) -> None:
    level = logging.DEBUG if request.path in QUIET_PATHS else logging.INFO
    if ACCESS_LOGGER.isEnabledFor(level):
        ACCESS_LOGGER.log(level, "%s", access_line(request, status, time.monotonic() - start))


@web.middleware
async def access_log_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """The outermost middleware: it sees the status the error middleware answered with. A
    streamed answer is logged when its last chunk is sent (the handler returns then)."""
    start = time.monotonic()
    try:
        resp = await handler(request)
    except asyncio.CancelledError:  # the client went away (aiohttp cancels the handler)
        _log_access(request, CLIENT_CLOSED, start)
        raise
    except web.HTTPException as e:  # (what the error middleware passes on: below 400)
        _log_access(request, e.status, start)
        raise
    _log_access(request, resp.status, start)
    return resp


def _ratio(num: float, den: float) -> str:
    return f"{100.0 * num / den:.1f}%" if den > 0 else "-"


class EngineStatsLine:
    """The periodic engine line from two snapshots of `engine.stats()` (docs/serving.md, 'Engine
    stats keys'): rates over the interval between them."""

    def __init__(self) -> None:
        self._prev: dict[str, float] | None = None
        self._prev_t = 0.0

    def update(self, stats: dict[str, Any], now: float) -> str | None:
        """The line for the interval that ends now, or None when the engine had nothing to do
        in it (no request held and no token moved), and for the first snapshot."""
        keys = (
            "num_requests_running",
            "num_requests_waiting",
            "prompt_tokens",
            "generation_tokens",
            "prefix_cache_queried_tokens",
            "prefix_cache_hit_tokens",
            "kv_blocks_used",
            "kv_blocks_total",
            "mamba_slots_used",
            "mamba_slots_total",
        )
        cur = {k: engine_value(stats, k) for k in keys}
        prev, prev_t = self._prev, self._prev_t
        self._prev, self._prev_t = cur, now
        if prev is None:  # the first snapshot: rates need two (its line would say 0 tok/s)
            return None
        dt = now - prev_t

        def delta(k: str) -> float:
            return cur[k] - prev[k]

        busy = cur["num_requests_running"] + cur["num_requests_waiting"] > 0
        moved = delta("prompt_tokens") > 0 or delta("generation_tokens") > 0
        if not busy and not moved:
            return None

        def rate(k: str) -> float:
            return delta(k) / dt if dt > 0 else 0.0

        return (
            f"engine: {cur['num_requests_running']:.0f} running, {cur['num_requests_waiting']:.0f} waiting; "
            f"prompt {rate('prompt_tokens'):.1f} tok/s, generation {rate('generation_tokens'):.1f} tok/s; "
            f"prefix cache hit rate {_ratio(delta('prefix_cache_hit_tokens'), delta('prefix_cache_queried_tokens'))} "
            f"(since start {_ratio(cur['prefix_cache_hit_tokens'], cur['prefix_cache_queried_tokens'])}); "
            f"KV cache {_ratio(cur['kv_blocks_used'], cur['kv_blocks_total'])} used, "
            f"Mamba state slots {_ratio(cur['mamba_slots_used'], cur['mamba_slots_total'])} used"
        )


def _read(read: Callable[[], dict[str, Any] | None]) -> dict[str, Any] | None:
    try:
        return read()
    except Exception:  # an engine that stopped: /health says so, this line has nothing to add
        return None


async def log_engine_stats(read: Callable[[], dict[str, Any] | None], interval_s: float) -> None:
    """Every `interval_s` seconds, the engine line (while there is work); `read` gives the
    engine's stats, None while no engine is loaded. Runs until cancelled."""
    line = EngineStatsLine()
    # The first snapshot as soon as an engine is loaded (it has done no work yet): the baseline
    # of the first interval, so that work in it is counted and its rates are over its own time.
    while (first := _read(read)) is None:
        await asyncio.sleep(min(0.1, interval_s))
    line.update(first, time.monotonic())
    while True:
        await asyncio.sleep(interval_s)
        stats = _read(read)
        if stats is None:
            continue
        text = line.update(stats, time.monotonic())
        if text is not None:
            STATS_LOGGER.info("%s", text)
