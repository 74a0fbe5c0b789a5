"""`hybridserve bench serve`: an async load generator for any OpenAI-compatible server.

Streams `POST /v1/completions` (token-id prompts from `workloads.py`, `stream_options.include_usage`,
`ignore_eos` so every request generates `max_tokens` tokens) with Poisson arrivals at
`request_rate` requests/s (`inf`: all at once) under a concurrency limit, and measures per request:
time to first token (TTFT: first streamed chunk with a choice), the gaps between chunks (ITL), time
per output token after the first (TPOT), end-to-end latency (E2E), and the server's usage fields
(prompt, completion and cached tokens). When the server exposes hybridserve's `/metrics`, the
prefix-cache hit rate is the diff of `hybridserve_prefix_cache_hit_tokens_total` over the diff of
`hybridserve_prefix_cache_queried_tokens_total` across the run.

Follow-up turns (the `multi-turn` workload, and the `trace` workload's follow-ups) are built from
the server's real answers: those requests ask for vLLM's `return_token_ids`, and the output ids of
a turn go into the next turn's prompt, so that the next turn can hit the whole previous turn in a
prefix cache. A server that refuses the field (a 400 naming it) is asked again without it for the
rest of the run; where no ids come back, the workload's stand-in answer (multi-turn: random ids;
trace: the trace's own `output`) takes their place, and each request's record says which
(`prompt_answers`: "real" or "stand-in").

The `trace` workload replays a `traces.Trace`: a first turn is sent at its `arrival` (seconds
from the start), a follow-up `think_time` seconds after the request it follows has finished (both
times multiplied by `time_scale`), with the prompt `trace.full_prompt(id, outputs=real answers)`
and `max_tokens = len(output)`; every session runs on its own, concurrently with the others.

No torch here; matplotlib is imported only for `--plot`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from hybridserve.benchmarks.traces import Trace, TraceRequest
from hybridserve.benchmarks.workloads import Conversation, WorkloadSpec, build_workload

METRIC_HIT = "hybridserve_prefix_cache_hit_tokens_total"
METRIC_QUERIED = "hybridserve_prefix_cache_queried_tokens_total"
METRIC_GENERATED = "hybridserve_generation_tokens_total"
METRIC_PROMPT = "hybridserve_prompt_tokens_total"


@dataclass
class ServeConfig:
    base_url: str
    workload: WorkloadSpec
    request_rate: float = math.inf
    concurrency: int | None = None
    model: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    request_timeout: float = 600.0
    api_key: str | None = None
    progress: bool = True
    ready_timeout: float = 120.0  # wait this long for GET /health to answer 200 (503 = still loading)
    trace: Trace | None = None  # workload "trace": the requests to replay
    trace_source: str | None = None  # where the trace came from (a file, or the generator's arguments)
    trace_time_scale: float = 1.0  # multiplies a trace's arrival and think times


@dataclass
class RequestResult:
    index: int
    conversation: int
    turn: int
    prompt_len: int
    start: float = 0.0  # seconds since the benchmark started
    ttft: float | None = None
    e2e: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # seconds since the request started
    num_chunks: int = 0
    output_tokens: int = 0  # usage.completion_tokens (or the chunk count when the server sent no usage)
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None
    # the output ids the server returned (`return_token_ids`); None when it sent none
    output_ids: list[int] | None = None
    prompt_digest: str | None = None  # `prompt_digest` of the prompt sent
    # a follow-up turn: whether the earlier answers in its prompt are the server's real output
    # ("real") or stand-ins ("stand-in"); None for a first turn
    prompt_answers: str | None = None
    # trace workload: the request's id, the id it follows, and when it was due (seconds since the
    # benchmark started; `start` is when it was sent, later under a concurrency limit)
    request_id: str | None = None
    after: str | None = None
    due: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft is not None and self.e2e is not None


# ----------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    s = sorted(values)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def latency_stats(values_s: Sequence[float]) -> dict[str, float | int | None]:
    """mean, median, p90, p95, p99, min, max in milliseconds (None when there are no values)."""
    if not values_s:
        return {"n": 0, "mean_ms": None, "median_ms": None, "p90_ms": None, "p95_ms": None,
                "p99_ms": None, "min_ms": None, "max_ms": None}  # fmt: skip
    ms = [v * 1e3 for v in values_s]
    return {
        "n": len(ms),
        "mean_ms": statistics.fmean(ms),
        "median_ms": percentile(ms, 50),
        "p90_ms": percentile(ms, 90),
        "p95_ms": percentile(ms, 95),
        "p99_ms": percentile(ms, 99),
        "min_ms": min(ms),
        "max_ms": max(ms),
    }


def parse_prometheus(text: str) -> dict[str, float]:
    """Unlabelled samples of a Prometheus text exposition (`name value`)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) < 2 or "{" in parts[0]:
            continue
        try:
            out[parts[0]] = float(parts[1])
        except ValueError:
            continue
    return out


def prompt_digest(prompt: Sequence[int]) -> str:
    """A short fingerprint of a prompt's token ids (in each request's record), so that two runs can
    be checked to have sent the same prompts without storing them."""
    return hashlib.sha256(json.dumps(list(prompt), separators=(",", ":")).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- client


async def _get_json(session: Any, url: str) -> Any:
    async with session.get(url) as resp:
        if resp.status != 200:
            return None
        return await resp.json(content_type=None)  # (JSON whatever it says it is; ValueError if not)


async def wait_ready(session: Any, base_url: str, timeout: float) -> None:
    """Polls GET /health until it answers 200 (a server without /health, 404, counts as ready)."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        try:
            async with session.get(f"{base_url}/health") as resp:
                if resp.status in (200, 404):
                    return
                last = f"HTTP {resp.status}"
        except Exception as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() >= deadline:
            raise RuntimeError(f"{base_url} is not ready after {timeout:.0f} s ({last})")
        await asyncio.sleep(0.25)


async def scrape_metrics(session: Any, base_url: str) -> dict[str, float] | None:
    """hybridserve's /metrics counters, or None when the server has none."""
    try:
        async with session.get(f"{base_url}/metrics") as resp:
            if resp.status != 200:
                return None
            values = parse_prometheus(await resp.text())
    except Exception:
        return None
    return values if METRIC_QUERIED in values else None


@dataclass
class _TokenIds:
    """Whether requests that need the output ids ask for `return_token_ids` (until the server
    refuses the field once), and whether it was refused."""

    ask: bool
    refused: bool = False


def _names_return_token_ids(status: int, text: str) -> bool:
    return status == 400 and "return_token_ids" in text


async def _stream_one(
    session: Any,
    cfg: ServeConfig,
    model: str,
    prompt: list[int],
    r: RequestResult,
    t0: float,
    max_tokens: int,
    token_ids: _TokenIds | None = None,
) -> None:
    """Sends one streamed request and fills `r`. With `token_ids` (a request whose answer goes into
    a later prompt) it asks for `return_token_ids` and keeps the ids in `r.output_ids`; a 400 that
    names the field switches the asking off for the run and sends the request again without it."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    texts: list[str] = []
    ids: list[int] | None = None
    try:
        while True:
            asked = token_ids is not None and token_ids.ask
            if asked:
                body["return_token_ids"] = True
            else:
                body.pop("return_token_ids", None)
            start = time.perf_counter()
            r.start = start - t0
            async with session.post(f"{cfg.base_url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    if asked and token_ids is not None and _names_return_token_ids(resp.status, text):
                        token_ids.ask, token_ids.refused = False, True
                        continue
                    r.error = f"HTTP {resp.status}: {text[:200]}"
                    return
                ids = [] if asked else None
                buf = b""
                async for data in resp.content.iter_any():
                    buf += data
                    while b"\n" in buf:
                        raw, buf = buf.split(b"\n", 1)
                        line = raw.strip()
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            continue
                        now = time.perf_counter() - start
                        chunk = json.loads(payload)
                        if "error" in chunk:
                            r.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                            continue
                        choices = chunk.get("choices") or []
                        if choices:
                            c = choices[0]
                            if r.ttft is None:
                                r.ttft = now
                            r.chunk_times.append(now)
                            texts.append(c.get("text") or "")
                            if c.get("finish_reason") is not None:
                                r.finish_reason = c["finish_reason"]
                            if ids is not None:
                                new = c.get("token_ids")
                                if isinstance(new, list):
                                    ids.extend(new)
                                else:  # a chunk without them: the server does not return ids after all
                                    ids = None
                        usage = chunk.get("usage")
                        if usage:
                            _read_usage(r, usage)
            r.e2e = time.perf_counter() - start
            if r.error is None and r.ttft is None:
                r.error = "the stream ended without a chunk of the answer"
            if r.error is None and r.finish_reason in ("abort", "error"):
                # (a server that shuts down ends its streams so: the answer is cut short, and
                # its tokens and times would pass for a whole request's)
                r.error = f"the server ended the request with finish_reason {r.finish_reason!r}"
            break
    except Exception as e:  # the run goes on; the request counts as failed
        r.error = f"{type(e).__name__}: {e}"[:200]
    r.num_chunks = len(r.chunk_times)
    r.text = "".join(texts)
    r.output_tokens = r.usage_completion_tokens if r.usage_completion_tokens is not None else r.num_chunks
    # ids that do not add up to the server's own count are not the answer: the stand-in is used
    if ids is not None and r.ok and (r.usage_completion_tokens in (None, len(ids))):
        r.output_ids = ids


def _read_usage(r: RequestResult, usage: Any) -> None:
    """A chunk's `usage` into `r`; counts that are not counts fail the request, saying which."""

    def count(v: Any) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None

    if not isinstance(usage, dict):
        r.error = f"the server's usage is not an object: {usage!r}"[:200]
        return
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    got = {
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "prompt_tokens_details.cached_tokens": cached,
    }
    for name, v in got.items():
        if v is not None and count(v) is None:
            r.error = f"the server's usage.{name} is not a count: {v!r}"[:200]
            return
    r.usage_prompt_tokens = count(got["prompt_tokens"])
    r.usage_completion_tokens = count(got["completion_tokens"])
    r.cached_tokens = count(got["prompt_tokens_details.cached_tokens"])
    if (
        r.cached_tokens is not None
        and r.usage_prompt_tokens is not None
        and r.cached_tokens > r.usage_prompt_tokens
    ):
        r.error = f"the server's usage says {r.cached_tokens} cached of {r.usage_prompt_tokens} prompt tokens"


async def _find_model(session: Any, cfg: ServeConfig) -> str:
    if cfg.model is not None:
        return cfg.model
    url = f"{cfg.base_url}/v1/models"
    async with session.get(url) as resp:
        if resp.status in (401, 403):
            raise RuntimeError(
                f"{url} answers HTTP {resp.status}: the server wants an API key (--api-key), or another one"
            )
    try:
        models = await _get_json(session, url)
    except ValueError:  # not JSON
        models = None
    data = models.get("data") if isinstance(models, dict) else None
    first = data[0] if isinstance(data, list) and data else None
    if not isinstance(first, dict) or not isinstance(first.get("id"), str):
        raise RuntimeError(
            f"{url} gives no model list with an id (OpenAI's {{data: [{{id}}]}}); pass --model"
        )
    return first["id"]


def _answers_kind(answers: Sequence[Sequence[int] | None]) -> str:
    return "real" if all(a is not None for a in answers) else "stand-in"


async def run_serve(cfg: ServeConfig) -> dict[str, Any]:
    """Runs the benchmark; returns the result dict (see `summarize`)."""
    import aiohttp

    if cfg.workload.name == "trace":
        if cfg.trace is None:
            raise ValueError("the trace workload needs ServeConfig.trace")
        convs: list[Conversation] = []
        results = _trace_rows(cfg.trace)
    else:
        convs = build_workload(cfg.workload)
        results = []
        plan: list[list[RequestResult]] = []
        for ci, conv in enumerate(convs):
            rows = []
            for ti, p in enumerate(conv.prompts):
                rr = RequestResult(index=len(results), conversation=ci, turn=ti, prompt_len=len(p))
                results.append(rr)
                rows.append(rr)
            plan.append(rows)
    # the output ids are needed where an answer goes into a later prompt
    follow_ups = cfg.trace is not None or any(len(c.prompts) > 1 for c in convs)
    token_ids = _TokenIds(ask=follow_ups)

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    timeout = aiohttp.ClientTimeout(total=None, sock_read=cfg.request_timeout)
    connector = aiohttp.TCPConnector(limit=cfg.concurrency or 0)
    progress: Any = None
    if cfg.progress:
        from tqdm import tqdm

        progress = tqdm(total=len(results), desc=f"bench serve {cfg.workload.name}", file=sys.stderr)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as session:
        await wait_ready(session, cfg.base_url, cfg.ready_timeout)
        model = await _find_model(session, cfg)
        before = await scrape_metrics(session, cfg.base_url)
        sem = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
        t0 = time.perf_counter()

        async def send(prompt: list[int], rr: RequestResult, max_tokens: int) -> None:
            rr.prompt_len = len(prompt)
            rr.prompt_digest = prompt_digest(prompt)
            ids = token_ids if follow_ups else None
            if sem is not None:
                async with sem:
                    await _stream_one(session, cfg, model, prompt, rr, t0, max_tokens, ids)
            else:
                await _stream_one(session, cfg, model, prompt, rr, t0, max_tokens, ids)
            if progress is not None:
                progress.update(1)

        if cfg.trace is not None:
            await _replay_trace(cfg.trace, results, send, t0, cfg.trace_time_scale)
        else:

            async def conversation(conv: Conversation, rows: list[RequestResult]) -> None:
                answers: list[list[int] | None] = []  # the server's answer to each turn so far
                for turn, rr in enumerate(rows):
                    if turn > 0:
                        rr.prompt_answers = _answers_kind(answers)
                    await send(conv.prompt(turn, answers), rr, cfg.workload.max_tokens)
                    answers.append(rr.output_ids)

            rng = random.Random(cfg.workload.seed + 1)
            tasks = []
            for i, (conv, rows) in enumerate(zip(convs, plan)):
                # Poisson arrivals: a gap before each conversation but the first (none after the
                # last, which would count as run time and lower every rate)
                if i > 0 and math.isfinite(cfg.request_rate) and cfg.request_rate > 0:
                    await asyncio.sleep(rng.expovariate(cfg.request_rate))
                tasks.append(asyncio.create_task(conversation(conv, rows)))
            await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        after = await scrape_metrics(session, cfg.base_url)
    if progress is not None:
        progress.close()
    return summarize(cfg, model, results, duration, before, after, token_ids)


def _trace_rows(trace: Trace) -> list[RequestResult]:
    """One result per trace request, in file order: `conversation` is its session's index in
    `trace.sessions()`, `turn` its place in the session."""
    where: dict[str, tuple[int, int]] = {}
    for si, sess in enumerate(trace.sessions()):
        for ti, req in enumerate(sess):
            where[req.id] = (si, ti)
    return [
        RequestResult(
            index=i,
            conversation=where[req.id][0],
            turn=where[req.id][1],
            prompt_len=trace.prompt_len(req.id),
            request_id=req.id,
            after=req.after,
        )
        for i, req in enumerate(trace.requests)
    ]


async def _replay_trace(
    trace: Trace,
    results: list[RequestResult],
    send: Callable[[list[int], RequestResult, int], Awaitable[None]],
    t0: float,
    time_scale: float,
) -> None:
    """Sends every request of `trace` at its time: a first turn at t0 + arrival * time_scale, a
    follow-up think_time * time_scale after the request it follows has finished (failed or not),
    with the real answers of its earlier turns in its prompt where the server returned them."""
    outputs: dict[str, list[int]] = {}  # the server's real answer to each request, by id
    finished: dict[str, asyncio.Event] = {r.id: asyncio.Event() for r in trace.requests}
    end: dict[str, float] = {}  # perf_counter when the request finished

    def earlier_turns(req: TraceRequest) -> list[str]:
        chain = []
        while req.after is not None:
            chain.append(req.after)
            req = trace.request(req.after)
        return chain

    async def one(req: TraceRequest, rr: RequestResult) -> None:
        try:
            if req.after is None:
                assert req.arrival is not None
                due = t0 + req.arrival * time_scale
            else:
                await finished[req.after].wait()
                due = end[req.after] + req.think_time * time_scale
                rr.prompt_answers = "real" if all(e in outputs for e in earlier_turns(req)) else "stand-in"
            rr.due = due - t0
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await send(trace.full_prompt(req.id, outputs=outputs), rr, len(req.output))
            if rr.output_ids is not None:
                outputs[req.id] = rr.output_ids
        finally:
            end[req.id] = time.perf_counter()
            finished[req.id].set()

    await asyncio.gather(*(one(req, rr) for req, rr in zip(trace.requests, results)))


def _server_prefix(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
    if before is None or after is None:
        return None
    queried = after.get(METRIC_QUERIED, 0.0) - before.get(METRIC_QUERIED, 0.0)
    hit = after.get(METRIC_HIT, 0.0) - before.get(METRIC_HIT, 0.0)
    return {
        "queried_tokens": queried,
        "hit_tokens": hit,
        # (None when the counters do not make a rate: another client's traffic, a restarted server)
        "hit_rate": hit / queried if queried > 0 and 0 <= hit <= queried else None,
        "generation_tokens": after.get(METRIC_GENERATED, 0.0) - before.get(METRIC_GENERATED, 0.0),
        "prompt_tokens": after.get(METRIC_PROMPT, 0.0) - before.get(METRIC_PROMPT, 0.0),
    }


def throughput_over_time(results: Sequence[RequestResult], duration: float, bins: int = 60) -> dict[str, Any]:
    """Output tokens per second in equal time bins (each chunk carries output_tokens / num_chunks)."""
    bin_s = max(duration / bins, 1e-3)
    n = max(1, math.ceil(duration / bin_s))
    counts = [0.0] * n
    for r in results:
        if not r.ok or not r.chunk_times:
            continue
        per_chunk = r.output_tokens / len(r.chunk_times)
        for t in r.chunk_times:
            counts[min(n - 1, int((r.start + t) / bin_s))] += per_chunk
    return {"bin_s": bin_s, "output_tok_per_s": [c / bin_s for c in counts]}


def summarize(
    cfg: ServeConfig,
    model: str,
    results: list[RequestResult],
    duration: float,
    before: dict[str, float] | None,
    after: dict[str, float] | None,
    token_ids: _TokenIds | None = None,
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(
        r.usage_prompt_tokens if r.usage_prompt_tokens is not None else r.prompt_len for r in ok
    )
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]  # type: ignore[operator]
    wl = asdict(cfg.workload) if cfg.trace is None else _trace_config(cfg, cfg.trace)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (out_tokens + prompt_tokens) / duration if duration > 0 else 0.0,
        "ttft": latency_stats([r.ttft for r in ok]),  # type: ignore[misc]
        "tpot": latency_stats(tpot),
        "itl": latency_stats(itl),
        "e2e": latency_stats([r.e2e for r in ok]),  # type: ignore[misc]
        "usage_cached_tokens": sum(cached) if cached else None,
        "usage_cache_hit_rate": (sum(cached) / prompt_tokens) if cached and prompt_tokens else None,
        "server_prefix_cache": _server_prefix(before, after),
        "follow_ups": _follow_ups(results, token_ids),
    }
    if cfg.trace is not None:
        ttft = summary["ttft"]
        summary["trace"] = {
            # the same sums as usage_cache_hit_rate, under the name a trace report uses
            "token_hit_rate": summary["usage_cache_hit_rate"],
            "ttft_p50_ms": ttft["median_ms"],
            "ttft_p95_ms": ttft["p95_ms"],
            "ttft_p99_ms": ttft["p99_ms"],
            # how late requests were sent (a concurrency limit, or a client that cannot keep up)
            "max_send_delay_ms": max(
                ((r.start - r.due) * 1e3 for r in ok if r.due is not None), default=None
            ),
        }
    errors = sorted({r.error for r in results if r.error})[:5]
    # Raw ITL samples (ms, rounded) for the charts; at most 5000 of them.
    itl_ms = [round(v * 1e3, 3) for v in itl[:5000]]
    return {
        "benchmark": "serve",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "config": {
            "base_url": cfg.base_url,
            "model": model,
            # (a trace's arrivals are its own times)
            "request_rate": "trace"
            if cfg.trace is not None
            else "inf"
            if math.isinf(cfg.request_rate)
            else cfg.request_rate,
            "concurrency": cfg.concurrency,
            "ignore_eos": cfg.ignore_eos,
            "temperature": cfg.temperature,
            "workload": wl,
        },
        "summary": summary,
        "errors": errors,
        "throughput_over_time": throughput_over_time(ok, duration),
        "itl_samples_ms": itl_ms,
        "requests": [_request_record(r, cfg.trace is not None) for r in results],
    }


def _request_record(r: RequestResult, trace: bool) -> dict[str, Any]:
    rec: dict[str, Any] = {}
    if trace:
        rec.update(id=r.request_id, session=r.conversation, after=r.after, due_s=r.due)
    rec.update(
        {
            "conversation": r.conversation,
            "turn": r.turn,
            "start_s": r.start,
            "prompt_len": r.prompt_len,
            "prompt_digest": r.prompt_digest,
            "prompt_tokens": r.usage_prompt_tokens,
            "output_tokens": r.output_tokens,
            "num_chunks": r.num_chunks,
            "cached_tokens": r.cached_tokens,
            "ttft_ms": None if r.ttft is None else r.ttft * 1e3,
            "e2e_ms": None if r.e2e is None else r.e2e * 1e3,
            "finish_reason": r.finish_reason,
            "error": r.error,
            "prompt_answers": r.prompt_answers,
            "returned_token_ids": r.output_ids is not None,
        }
    )
    return rec


def _trace_config(cfg: ServeConfig, trace: Trace) -> dict[str, Any]:
    return {
        "name": "trace",
        "trace": trace.name,
        "source": cfg.trace_source,
        "num_requests": len(trace),
        "sessions": len(trace.sessions()),
        "time_scale": cfg.trace_time_scale,
        # with the trace's own outputs; the real answers can make the follow-ups' prompts differ
        "prompt_tokens": trace.num_prompt_tokens(),
        "output_tokens": trace.num_output_tokens(),
    }


def _follow_ups(results: Sequence[RequestResult], token_ids: _TokenIds | None) -> dict[str, Any] | None:
    """How the follow-up turns' prompts were built; None for a workload without follow-ups."""
    follow = [r for r in results if r.prompt_answers is not None]
    if not follow:
        return None
    ok = [r for r in follow if r.ok]
    prompt = sum(r.usage_prompt_tokens if r.usage_prompt_tokens is not None else r.prompt_len for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    return {
        "requests": len(follow),
        "real_answers": sum(r.prompt_answers == "real" for r in follow),
        "stand_in_answers": sum(r.prompt_answers == "stand-in" for r in follow),
        "return_token_ids_refused": bool(token_ids is not None and token_ids.refused),
        "usage_cache_hit_rate": sum(cached) / prompt if cached and prompt else None,
    }


def machine_info() -> dict[str, Any]:
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "load_average": load,
    }


def format_summary(result: dict[str, Any]) -> str:
    s = result["summary"]
    c = result["config"]
    lines = [
        f"== bench serve: {c['workload']['name']}  model={c['model']}  rate={c['request_rate']}  "
        f"concurrency={c['concurrency']}  requests={c['workload']['num_requests']}",
        f"completed {s['completed']}  failed {s['failed']}  duration {s['duration_s']:.2f} s",
        f"throughput: {s['request_throughput']:.2f} req/s  {s['output_throughput']:.1f} output tok/s  "
        f"{s['total_token_throughput']:.1f} total tok/s",
    ]
    for key, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E")):
        st = s[key]
        if st["n"]:
            lines.append(
                f"{name:5s} ms: mean {st['mean_ms']:9.2f}  median {st['median_ms']:9.2f}  "
                f"p90 {st['p90_ms']:9.2f}  p99 {st['p99_ms']:9.2f}"
            )
    sp = s["server_prefix_cache"]
    if sp is not None and sp["hit_rate"] is not None:
        lines.append(
            f"prefix cache (server /metrics): hit rate {sp['hit_rate']:.3f} "
            f"({sp['hit_tokens']:.0f} / {sp['queried_tokens']:.0f} tokens)"
        )
    if s["usage_cache_hit_rate"] is not None:
        lines.append(f"prefix cache (usage.cached_tokens / prompt tokens): {s['usage_cache_hit_rate']:.3f}")
    fu = s.get("follow_ups")
    if fu is not None:
        rate = fu["usage_cache_hit_rate"]
        lines.append(
            f"follow-up turns: {fu['requests']} ({fu['real_answers']} with the server's real answers, "
            f"{fu['stand_in_answers']} with stand-ins"
            + ("; the server refused return_token_ids" if fu["return_token_ids_refused"] else "")
            + ")"
            + (f", hit rate {rate:.3f}" if rate is not None else "")
        )
    tr = s.get("trace")
    if tr is not None:
        w = c["workload"]
        ms = [tr[k] for k in ("ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms")]
        lines.append(
            f"trace {w['trace']}: {w['sessions']} sessions, time scale {w['time_scale']:g}; token hit rate "
            + ("n/a" if tr["token_hit_rate"] is None else f"{tr['token_hit_rate']:.3f}")
            + ("" if None in ms else "; TTFT p50 / p95 / p99 {:.1f} / {:.1f} / {:.1f} ms".format(*ms))
        )
    for e in result["errors"]:
        lines.append(f"error: {e}")
    return "\n".join(lines)


def serve_main(cfg: ServeConfig, result_file: str | None, plot_dir: str | None) -> dict[str, Any]:
    result = asyncio.run(run_serve(cfg))
    print(format_summary(result))
    if result_file:
        from pathlib import Path

        Path(result_file).parent.mkdir(parents=True, exist_ok=True)
        Path(result_file).write_text(json.dumps(result, indent=1) + "\n")
        print(f"result: {result_file}")
    if plot_dir:
        from hybridserve.benchmarks.plots import plot_serve

        for path in plot_serve(result, plot_dir):
            print(f"chart: {path}")
    return result
