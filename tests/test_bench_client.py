"""`hybridserve bench serve` against the REAL server (`python -m hybridserve serve demo` in a
subprocess, real engine): the client's numbers must agree with the server's own accounting
(usage fields and /metrics counters) and be internally consistent. No timed assertions."""

from __future__ import annotations

import json
import math
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridserve.benchmarks.serve_client import parse_prometheus
from hybridserve.cli import main as cli_main
from hybridserve.model.demo import ensure_demo_model
from server_fixtures import ServerProcess

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    ensure_demo_model()
    # M = 64 so that short shared prefixes can hit
    srv = ServerProcess("--max-model-len", "512", "--mamba-block-size", "64", "--max-num-seqs", "8")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _metrics(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        return parse_prometheus(r.read().decode())


def _bench(server: ServerProcess, tmp_path: Path, name: str, *extra: str) -> dict:
    out = tmp_path / f"{name}.json"
    rc = cli_main(
        ["bench", "serve", "--base-url", server.base, "--max-tokens", str(MAX_TOKENS), "--no-progress", "--request-timeout", "60",
         "--result-file", str(out), *extra]
    )  # fmt: skip
    assert rc == 0
    return json.loads(out.read_text())


def _check_stats(st: dict, n: int) -> None:
    assert st["n"] == n
    assert 0 < st["min_ms"] <= st["median_ms"] <= st["p90_ms"] <= st["p99_ms"] <= st["max_ms"]
    assert st["min_ms"] <= st["mean_ms"] <= st["max_ms"]


def test_random_workload_numbers_match_the_server(server: ServerProcess, tmp_path: Path) -> None:
    before = _metrics(server.base)
    r = _bench(server, tmp_path, "random", "--workload", "random", "--num-requests", "8", "--prompt-len", "48",
               "--plot", str(tmp_path / "charts"))  # fmt: skip
    after = _metrics(server.base)
    s = r["summary"]
    assert s["completed"] == 8 and s["failed"] == 0 and r["errors"] == []
    reqs = r["requests"]
    assert len(reqs) == 8
    for q in reqs:
        # the server's usage fields: every prompt token counted, exactly max_tokens generated (ignore_eos)
        assert q["prompt_tokens"] == q["prompt_len"] == 48
        assert q["output_tokens"] == MAX_TOKENS
        assert q["num_chunks"] == MAX_TOKENS  # one streamed chunk per token without speculation
        assert q["finish_reason"] == "length"
        assert 0 < q["ttft_ms"] <= q["e2e_ms"]
        assert q["start_s"] >= 0
    assert s["total_output_tokens"] == 8 * MAX_TOKENS
    assert s["total_prompt_tokens"] == 8 * 48
    # ... and the server's counters agree with the client's totals
    assert (
        after["hybridserve_generation_tokens_total"] - before["hybridserve_generation_tokens_total"]
        == 8 * MAX_TOKENS
    )
    assert after["hybridserve_prompt_tokens_total"] - before["hybridserve_prompt_tokens_total"] == 8 * 48
    _check_stats(s["ttft"], 8)
    _check_stats(s["e2e"], 8)
    _check_stats(s["itl"], 8 * (MAX_TOKENS - 1))
    _check_stats(s["tpot"], 8)
    assert s["ttft"]["max_ms"] <= s["e2e"]["max_ms"]
    assert s["duration_s"] * 1e3 >= s["e2e"]["max_ms"]
    assert math.isclose(s["request_throughput"], 8 / s["duration_s"])
    assert math.isclose(s["output_throughput"], 8 * MAX_TOKENS / s["duration_s"])
    # throughput over time integrates to the output tokens
    tot = r["throughput_over_time"]
    assert math.isclose(sum(tot["output_tok_per_s"]) * tot["bin_s"], 8 * MAX_TOKENS, rel_tol=1e-6)
    # random prompts share nothing: the hit rate is a number in [0, 1], here 0
    sp = s["server_prefix_cache"]
    assert sp is not None and sp["queried_tokens"] == 8 * 48
    assert 0.0 <= sp["hit_rate"] <= 1.0
    assert sp["hit_tokens"] == 0 and s["usage_cached_tokens"] == 0
    charts = sorted(p.name for p in (tmp_path / "charts").iterdir())
    assert charts == ["serve_random_latency.png", "serve_random_throughput.png"]
    for name in charts:
        assert (tmp_path / "charts" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_shared_prefix_hit_rate_from_metrics(server: ServerProcess, tmp_path: Path) -> None:
    # 8 prompts of 96 tokens sharing 80; 2 at a time, so later requests find the prefix cached.
    r = _bench(server, tmp_path, "shared", "--workload", "shared-prefix", "--num-requests", "8",
               "--prompt-len", "96", "--prefix-len", "80", "--concurrency", "2")  # fmt: skip
    s = r["summary"]
    assert s["completed"] == 8 and s["failed"] == 0
    sp = s["server_prefix_cache"]
    assert sp["queried_tokens"] == 8 * 96
    assert 0.0 < sp["hit_rate"] <= 1.0
    # hits come in whole checkpoints (M = 64) and at most the shared 80 tokens per request
    assert sp["hit_tokens"] % 64 == 0 and sp["hit_tokens"] <= 8 * 64
    # the usage fields (cached_tokens per request) add up to the server's hit counter
    assert s["usage_cached_tokens"] == sp["hit_tokens"]
    assert math.isclose(s["usage_cache_hit_rate"], sp["hit_rate"])
    assert all(q["output_tokens"] == MAX_TOKENS for q in r["requests"])
    assert r["config"]["concurrency"] == 2


def test_multi_turn_prompts_extend_each_other(server: ServerProcess, tmp_path: Path) -> None:
    r = _bench(server, tmp_path, "multi", "--workload", "multi-turn", "--num-requests", "4", "--num-turns", "2",
               "--prompt-len", "72")  # fmt: skip
    s = r["summary"]
    assert s["completed"] == 4
    reqs = r["requests"]
    assert [(q["conversation"], q["turn"]) for q in reqs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for q in reqs:
        # turn 2 = turn 1's prompt + a stand-in answer (max_tokens ids) + a new 72-token message
        assert q["prompt_tokens"] == (72 if q["turn"] == 0 else 72 + MAX_TOKENS + 72)
    # a second turn is sent only after the first one has finished
    for c in (0, 1):
        first, second = (q for q in reqs if q["conversation"] == c)
        assert second["start_s"] * 1e3 >= first["start_s"] * 1e3 + first["e2e_ms"] - 1e-3
        assert second["cached_tokens"] == 64  # turn 1's prompt (72 tokens) holds one M = 64 checkpoint
