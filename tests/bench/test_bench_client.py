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

from hybridserve.benchmarks.serve_client import parse_prometheus, prompt_digest
from hybridserve.benchmarks.traces import T2Shape, generate, write_trace
from hybridserve.benchmarks.workloads import WorkloadSpec, build_workload
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


def _complete(server: ServerProcess, prompt: list[int], max_tokens: int) -> list[int]:
    """The server's greedy output ids for a token-id prompt."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    req = urllib.request.Request(
        server.base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return list(json.loads(r.read())["choices"][0]["token_ids"])


def _bench(server: ServerProcess, tmp_path: Path, name: str, *extra: str) -> dict:
    out = tmp_path / f"{name}.json"
    # (a trace sets its own lengths: --max-tokens is refused with it)
    sizes = [] if "trace" in extra else ["--max-tokens", str(MAX_TOKENS)]
    rc = cli_main(
        ["bench", "serve", "--base-url", server.base, *sizes, "--no-progress", "--request-timeout", "60",
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


def test_the_run_ends_with_its_last_request_at_a_finite_rate(server: ServerProcess, tmp_path: Path) -> None:
    """Poisson arrivals at 0.05 requests/s (gaps of 20 s on average): the run is its requests,
    not the gap a next arrival would have waited (the rates are counted over the run)."""
    r = _bench(server, tmp_path, "rate", "--workload", "random", "--num-requests", "1", "--prompt-len", "8",
               "--request-rate", "0.05")  # fmt: skip
    (q,) = r["requests"]
    assert r["summary"]["completed"] == 1
    assert r["summary"]["duration_s"] <= q["start_s"] + q["e2e_ms"] / 1e3 + 1.0, (
        r["summary"]["duration_s"],
        q,
    )


def test_shared_prefix_hit_rate_from_metrics(server: ServerProcess, tmp_path: Path) -> None:
    # 8 prompts of 96 tokens sharing 80; 2 at a time, so later requests find the prefix cached.
    r = _bench(server, tmp_path, "shared", "--workload", "shared-prefix", "--num-requests", "8",
               "--prompt-len", "96", "--prefix-len", "80", "--concurrency", "2")  # fmt: skip
    s = r["summary"]
    assert s["completed"] == 8 and s["failed"] == 0
    sp = s["server_prefix_cache"]
    assert sp["queried_tokens"] == 8 * 96
    assert 0.0 < sp["hit_rate"] <= 1.0
    # a request that found the shared 80 tokens cached without a state kept one there (80 is a
    # whole number of 16-token blocks); before that, a request may hit the grid point at 64
    cached = [q["cached_tokens"] for q in r["requests"]]
    assert set(cached) <= {0, 64, 80} and 80 in cached
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
    # every turn asked for the output ids and got them; turn 2 was built from the real answer
    assert all(q["returned_token_ids"] for q in reqs)
    assert [q["prompt_answers"] for q in reqs] == [None, "real", None, "real"]
    fu = s["follow_ups"]
    assert (fu["requests"], fu["real_answers"], fu["stand_in_answers"]) == (2, 2, 0)
    assert fu["return_token_ids_refused"] is False
    for q in reqs:
        assert q["prompt_tokens"] == q["prompt_len"] == (72 if q["turn"] == 0 else 72 + MAX_TOKENS + 72)
    convs = build_workload(WorkloadSpec(name="multi-turn", num_requests=4, prompt_len=72, max_tokens=MAX_TOKENS,
                                        num_turns=2))  # fmt: skip
    for c, conv in enumerate(convs):
        first, second = (q for q in reqs if q["conversation"] == c)
        # turn 2 = turn 1's prompt + turn 1's real answer (greedy: what the server says again now)
        # + a new 72-token message
        answer = _complete(server, conv.prompt(0), MAX_TOKENS)
        assert len(answer) == MAX_TOKENS and answer != conv.stand_ins[0]
        assert first["prompt_digest"] == prompt_digest(conv.messages[0])
        assert second["prompt_digest"] == prompt_digest(conv.messages[0] + answer + conv.messages[1])
        # a second turn is sent only after the first one has finished
        assert second["start_s"] * 1e3 >= first["start_s"] * 1e3 + first["e2e_ms"] - 1e-3
        # the server kept the Mamba state after turn 1's last computed token: turn 1's prompt and
        # answer, all but the answer's last token (sampled, never fed back), are a hit; a hit can
        # end inside a 16-token KV block and off the M = 64 grid (79 = 4 * 16 + 15)
        assert first["cached_tokens"] == 0
        assert second["cached_tokens"] == 72 + MAX_TOKENS - 1


# A T2 ("multi-turn chat") trace small enough for a few seconds on the demo model: 3 sessions of 2-3
# turns, short prompts and answers, think times of a few tens of ms.
TINY_T2 = T2Shape(
    num_sessions=3, session_rate=20.0, turns=(2, 3), num_system_prompts=2, system_prompt_len=(40, 60),
    message_len=(10, 20), output_len=(4, 8), mean_think_time=0.05,
)  # fmt: skip


def test_trace_replays_sessions_with_the_real_answers(server: ServerProcess, tmp_path: Path) -> None:
    trace = generate("T2", seed=3, shape=TINY_T2)
    path = tmp_path / "t2.jsonl"
    write_trace(trace, path)
    r = _bench(server, tmp_path, "trace", "--workload", "trace", "--trace", str(path))
    s = r["summary"]
    reqs = r["requests"]
    assert s["completed"] == len(trace) == len(reqs) and s["failed"] == 0
    w = r["config"]["workload"]
    assert (w["name"], w["trace"], w["source"], w["sessions"]) == ("trace", trace.name, str(path), 3)
    assert r["config"]["request_rate"] == "trace"  # (its arrivals are the trace's own times)
    by_id = {q["id"]: q for q in reqs}
    assert [q["id"] for q in reqs] == [t.id for t in trace.requests]
    outputs: dict[str, list[int]] = {}
    for t in trace.requests:  # (file order: a request's predecessor comes first)
        q = by_id[t.id]
        assert q["after"] == t.after and q["error"] is None
        # max_tokens = len(output), and ignore_eos: exactly that many
        assert q["output_tokens"] == len(t.output) and q["finish_reason"] == "length"
        if t.after is None:
            assert q["prompt_answers"] is None and q["turn"] == 0
            assert q["due_s"] == pytest.approx(t.arrival) and q["start_s"] >= t.arrival
        else:
            prev = by_id[t.after]
            assert q["session"] == prev["session"] and q["turn"] > prev["turn"]
            # sent think_time after the request it follows had finished
            prev_end = prev["start_s"] + prev["e2e_ms"] / 1e3
            assert q["due_s"] >= prev_end + t.think_time - 1e-6
            assert q["start_s"] >= q["due_s"]
            assert q["prompt_answers"] == "real"
            # the previous turn's prompt and answer, all but the answer's last token, were a hit
            assert q["cached_tokens"] == prev["prompt_tokens"] + prev["output_tokens"] - 1 > 0
        # the prompt is the trace's, with the server's real answers in place of the trace's outputs
        prompt = trace.full_prompt(t.id, outputs=outputs)
        assert q["prompt_digest"] == prompt_digest(prompt) and q["prompt_tokens"] == len(prompt)
        outputs[t.id] = _complete(server, prompt, len(t.output))
    assert any(outputs[t.id] != list(t.output) for t in trace.requests)  # real answers, not the trace's
    tr = s["trace"]
    cached = sum(q["cached_tokens"] for q in reqs)
    assert tr["token_hit_rate"] == pytest.approx(cached / sum(q["prompt_tokens"] for q in reqs))
    assert tr["token_hit_rate"] > 0
    assert 0 < tr["ttft_p50_ms"] <= tr["ttft_p95_ms"] <= tr["ttft_p99_ms"] <= s["ttft"]["max_ms"]
    assert s["follow_ups"]["real_answers"] == s["follow_ups"]["requests"] == len(trace) - 3


def test_a_generated_trace_request_the_server_refuses_is_a_request_error(
    server: ServerProcess, tmp_path: Path
) -> None:
    # a generated T4 (few-shot trees: first turns of 800-1900 tokens) at the smallest scale, sent
    # without waiting: longer than this server's context, so each request fails on its own
    out = tmp_path / "t4.json"
    rc = cli_main(["bench", "serve", "--base-url", server.base, "--no-progress", "--result-file", str(out),
                   "--workload", "trace", "--trace", "t4", "--trace-scale", "0.005", "--trace-seed", "1",
                   "--trace-time-scale", "0"])  # fmt: skip
    assert rc == 1  # nothing completed
    r = json.loads(out.read_text())
    trace = generate("T4", seed=1, scale=0.005)
    assert r["config"]["workload"]["source"] == "T4 seed=1 scale=0.005"
    assert r["config"]["workload"]["trace"] == trace.name and r["config"]["workload"]["time_scale"] == 0
    assert r["summary"]["failed"] == len(trace) == len(r["requests"]) == 2
    for q, t in zip(r["requests"], trace.requests):
        assert q["id"] == t.id and q["due_s"] == 0.0 and q["prompt_len"] == len(t.prompt or ())
        assert q["error"].startswith("HTTP 400") and "maximum context length" in q["error"]
    assert r["summary"]["trace"]["token_hit_rate"] is None and r["summary"]["follow_ups"] is None


def test_a_malformed_trace_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"trace": "bad"}\n{"id": "a", "arrival": 0, "prompt": [5, 6], "output": [7]}\n\n'
        '{"id": "b", "after": "a", "think_time": -1, "prompt_append": [8], "output": [9]}\n'
    )
    # no server is needed: the trace is read before anything is sent
    rc = cli_main(
        ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--workload", "trace", "--trace", str(path)]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith(f"hybridserve bench: error: --trace: {path}:4: ") and "think_time" in err
    assert "Traceback" not in err and err.count("\n") == 1
