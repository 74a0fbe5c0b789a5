"""Soak run of the real server: many requests of random lengths at a fixed concurrency, a share of
them aborted mid-stream. Passes when resident memory at the end is within 5% of what it was after
the first 1,000 requests, no KV block, state slot or request is left in use, and every completed
greedy output equals the output of the same request run alone.

    .venv/bin/python benches/soak.py [--requests 10000] [--concurrency 64] [--abort-fraction 0.2]
        [--distinct 200] [--seed 0] [--server-args "--max-model-len 1024"]
        [--result-file benches/results/soak.json]

Requests are drawn from `--distinct` shapes (a prompt of 4 to 200 words of the demo corpus and a
max_tokens of 1 to 48, greedy), so that the solo runs stay affordable and the prefix cache sees
repeats. An aborted request closes its stream after a random number of chunks. The solo runs go
to a second, fresh server with prefix caching off, one request at a time: no batching, no cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benches"))

from server_process import BenchServer  # noqa: E402

CORPUS = ROOT / "python" / "hybridserve" / "model" / "demo_corpus.txt"


@dataclass(frozen=True)
class Shape:
    prompt: str
    max_tokens: int


def make_shapes(n: int, rng: random.Random) -> list[Shape]:
    words = CORPUS.read_text().split()
    out = []
    for _ in range(n):
        length = rng.randint(4, 200)
        start = rng.randrange(0, len(words) - length)
        out.append(Shape(" ".join(words[start : start + length]), rng.randint(1, 48)))
    return out


async def stream_one(
    session: aiohttp.ClientSession, base: str, shape: Shape, abort_after: int | None
) -> tuple[str, str | None]:
    """(text, finish_reason) of one streamed completion; finish_reason None when aborted."""
    body = {
        "model": "demo",
        "prompt": shape.prompt,
        "max_tokens": shape.max_tokens,
        "temperature": 0,
        "stream": True,
    }
    text: list[str] = []
    chunks = 0
    async with session.post(f"{base}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data: ") :])["choices"][0]
            text.append(choice.get("text", ""))
            chunks += 1
            if choice.get("finish_reason"):
                return "".join(text), choice["finish_reason"]
            if abort_after is not None and chunks >= abort_after:
                r.close()  # the client goes away mid-stream
                return "".join(text), None
    raise RuntimeError("the stream ended without a finish_reason")


async def soak(a: argparse.Namespace, server: BenchServer, shapes: list[Shape]) -> dict[str, Any]:
    rng = random.Random(a.seed + 1)
    plan = []
    for _ in range(a.requests):
        shape = rng.randrange(len(shapes))
        aborted = rng.random() < a.abort_fraction
        after = rng.randint(1, max(1, shapes[shape].max_tokens // 2)) if aborted else None
        plan.append((shape, after))
    results: list[tuple[int, str, str | None]] = []
    rss_after_1000: int | None = None
    errors: list[str] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(plan)):
        queue.put_nowait(i)
    t0 = time.monotonic()

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal rss_after_1000
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            shape, after = plan[i]
            try:
                text, reason = await stream_one(session, server.base, shapes[shape], after)
                results.append((shape, text, reason))
            except Exception as exc:  # counted and reported: a soak run must show every failure
                errors.append(f"request {i}: {exc!r}")
            done = len(results) + len(errors)
            if done == 1000:
                rss_after_1000 = server.rss_bytes()
            if done % 1000 == 0:
                print(
                    f"{done} requests, {time.monotonic() - t0:.0f} s, RSS {server.rss_bytes() / 2**20:.0f} MiB",
                    flush=True,
                )

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=a.concurrency), timeout=timeout
    ) as s:
        await asyncio.gather(*(worker(s) for _ in range(a.concurrency)))
    await asyncio.sleep(0)  # let the closed connections' transports finish closing
    wall = time.monotonic() - t0
    return {"results": results, "errors": errors, "rss_after_1000": rss_after_1000, "wall_s": wall}


async def solo_runs(base: str, shapes: list[Shape], which: set[int]) -> dict[int, str]:
    out: dict[int, str] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        for k in sorted(which):
            text, reason = await stream_one(s, base, shapes[k], None)
            assert reason is not None
            out[k] = text
    return out


def wait_idle(server: BenchServer, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    m = server.metrics()
    while time.monotonic() < deadline:
        m = server.metrics()
        if (
            m.get("hybridserve_num_requests_running", 1) == 0
            and m.get("hybridserve_server_inflight_requests", 1) == 0
        ):
            break
        time.sleep(0.5)
    return m


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--abort-fraction", type=float, default=0.2)
    ap.add_argument("--distinct", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-args", default="--max-model-len 1024 --dtype float32")
    ap.add_argument("--result-file", default=str(ROOT / "benches" / "results" / "soak.json"))
    a = ap.parse_args()
    shapes = make_shapes(a.distinct, random.Random(a.seed))
    logs = Path(tempfile.gettempdir())
    server = BenchServer(
        [*shlex.split(a.server_args), "--max-queue-len", str(4 * a.concurrency)], logs / "soak.log"
    )
    try:
        server.wait_ready()
        rss_start = server.rss_bytes()
        run = asyncio.run(soak(a, server, shapes))
        idle = wait_idle(server)
        rss_end = server.rss_bytes()
    finally:
        rc = server.stop()
    completed = [(k, text) for k, text, reason in run["results"] if reason is not None]
    aborted = sum(1 for _, _, reason in run["results"] if reason is None)

    ref_server = BenchServer(
        [*shlex.split(a.server_args), "--no-enable-prefix-caching", "--max-num-seqs", "1"],
        logs / "soak_solo.log",
    )
    try:
        ref_server.wait_ready()
        solo = asyncio.run(solo_runs(ref_server.base, shapes, {k for k, _ in completed}))
    finally:
        ref_server.stop()
    mismatches = [k for k, text in completed if text != solo[k]]

    leaks = {
        "running": idle.get("hybridserve_num_requests_running"),
        "waiting": idle.get("hybridserve_num_requests_waiting"),
        "server_inflight": idle.get("hybridserve_server_inflight_requests"),
        "kv_blocks_used": idle.get("hybridserve_kv_blocks_used"),
        # slots in use beyond the prefix cache's checkpoints: running windows
        "state_slots_in_windows": idle.get("hybridserve_mamba_slots_used", 0)
        - idle.get("hybridserve_mamba_checkpoints_committed", 0)
        - idle.get("hybridserve_mamba_checkpoints_pending", 0),
    }
    rss_1000 = run["rss_after_1000"] or rss_end
    growth = rss_end / rss_1000 - 1
    ok = (
        not run["errors"]
        and not mismatches
        and all(v == 0 for v in leaks.values())
        and abs(growth) <= 0.05
        and rc == 0
    )
    summary = {
        "requests": a.requests,
        "concurrency": a.concurrency,
        "abort_fraction": a.abort_fraction,
        "distinct_shapes": a.distinct,
        "server_args": a.server_args,
        "wall_s": round(run["wall_s"], 1),
        "completed": len(completed),
        "aborted": aborted,
        "errors": run["errors"][:20],
        "num_errors": len(run["errors"]),
        "rss_start_mib": round(rss_start / 2**20, 1),
        "rss_after_1000_mib": round(rss_1000 / 2**20, 1),
        "rss_end_mib": round(rss_end / 2**20, 1),
        "rss_growth_after_1000": round(growth, 4),
        "in_use_when_idle": leaks,
        "completed_equal_to_solo": len(completed) - len(mismatches),
        "mismatches": len(mismatches),
        "server_exit_code": rc,
        "passed": ok,
    }
    print(json.dumps(summary, indent=1))
    Path(a.result_file).write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
