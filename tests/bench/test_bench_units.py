"""Pieces of the benchmark client that need no server: workloads, statistics, /metrics parsing, CLI."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from typing import Any

import pytest

from hybridserve.benchmarks.serve_client import latency_stats, parse_prometheus, percentile
from hybridserve.benchmarks.workloads import WorkloadSpec, build_workload
from hybridserve.cli import build_parser


def test_percentile_matches_linear_interpolation() -> None:
    v = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(v, 0) == 1.0
    assert percentile(v, 50) == 3.0
    assert percentile(v, 100) == 5.0
    assert math.isclose(percentile(v, 90), 4.6)
    assert math.isclose(percentile([1.0, 2.0], 99), 1.99)
    st = latency_stats([0.001, 0.002, 0.003])
    assert st["n"] == 3 and math.isclose(st["mean_ms"], 2.0) and math.isclose(st["median_ms"], 2.0)
    assert latency_stats([])["median_ms"] is None


def test_summary_latencies_and_throughputs_for_known_requests() -> None:
    """TTFT, TPOT (after the first token), ITL (gaps between chunks), E2E and the throughputs of
    hand-made requests; a failed request counts in none of them."""
    from hybridserve.benchmarks.serve_client import RequestResult, ServeConfig, summarize

    cfg = ServeConfig(base_url="http://x", workload=WorkloadSpec(name="random", num_requests=3))
    a = RequestResult(
        index=0,
        conversation=0,
        turn=0,
        prompt_len=10,
        ttft=0.1,
        e2e=0.4,
        chunk_times=[0.1, 0.2, 0.4],
        output_tokens=3,
        usage_prompt_tokens=10,
        cached_tokens=4,
    )
    b = RequestResult(
        index=1,
        conversation=1,
        turn=0,
        prompt_len=20,
        start=1.0,
        ttft=0.3,
        e2e=0.5,
        chunk_times=[0.3, 0.5],
        output_tokens=5,
        cached_tokens=0,
    )
    c = RequestResult(index=2, conversation=2, turn=0, prompt_len=99, ttft=0.01, e2e=9.0, error="x")  # fmt: skip
    r = summarize(cfg, "m", [a, b, c], 2.0, None, None)
    s = r["summary"]
    assert (s["completed"], s["failed"], s["total_prompt_tokens"], s["total_output_tokens"]) == (2, 1, 30, 8)
    assert (s["request_throughput"], s["output_throughput"], s["total_token_throughput"]) == (1.0, 4.0, 19.0)
    assert math.isclose(s["usage_cache_hit_rate"], 4 / 30)
    want = {"ttft": [100, 300], "tpot": [150, 50], "itl": [100, 200, 200], "e2e": [400, 500]}
    for key, ms in want.items():
        st = s[key]
        assert st["n"] == len(ms) and math.isclose(st["mean_ms"], sum(ms) / len(ms)), key
        assert math.isclose(st["p90_ms"], percentile(ms, 90)) and math.isclose(st["max_ms"], max(ms)), key
    # every output token lands in a time bin: the bins sum to the output tokens
    tot = r["throughput_over_time"]
    assert math.isclose(sum(tot["output_tok_per_s"]) * tot["bin_s"], 8.0)


def test_parse_prometheus_reads_unlabelled_samples() -> None:
    text = (
        "# HELP hybridserve_prefix_cache_hit_tokens_total x\n"
        "# TYPE hybridserve_prefix_cache_hit_tokens_total counter\n"
        "hybridserve_prefix_cache_hit_tokens_total 128.0\n"
        'hybridserve_requests_finished_total{finish_reason="length"} 8.0\n'
        "hybridserve_prefix_cache_queried_tokens_total 1.5e+03\n"
    )
    m = parse_prometheus(text)
    assert m == {
        "hybridserve_prefix_cache_hit_tokens_total": 128.0,
        "hybridserve_prefix_cache_queried_tokens_total": 1500.0,
    }


@pytest.mark.parametrize("name", ["random", "shared-prefix", "multi-turn", "repetitive"])
def test_workloads_are_seeded_and_sized(name: str) -> None:
    spec = WorkloadSpec(name=name, num_requests=7, prompt_len=40, max_tokens=5, seed=3, num_turns=3)
    convs = build_workload(spec)
    assert convs == build_workload(spec)  # same seed, same requests
    assert convs != build_workload(WorkloadSpec(**{**spec.__dict__, "seed": 4}))
    prompts = [p for c in convs for p in c.prompts]
    assert len(prompts) == 7
    assert all(3 <= t < 256 for p in prompts for t in p)
    if name != "multi-turn":
        assert all(len(p) == 40 for p in prompts) and all(len(c.prompts) == 1 for c in convs)
    if name == "shared-prefix":
        assert len({tuple(p[:30]) for p in prompts}) == 1  # 3/4 of 40 shared
        assert len({tuple(p[30:]) for p in prompts}) == 7
    if name == "random":
        assert len({tuple(p) for p in prompts}) == 7
    if name == "repetitive":
        assert all(p[16:32] == p[:16] for p in prompts)
    if name == "multi-turn":
        assert [len(c.prompts) for c in convs] == [3, 3, 1]
        for c in convs:
            for a, b in zip(c.prompts, c.prompts[1:]):
                assert b[: len(a)] == a and len(b) == len(a) + 5 + 40


def test_cli_parses_bench_modes() -> None:
    p = build_parser()
    a = p.parse_args(
        ["bench", "serve", "--workload", "multi-turn", "--request-rate", "inf", "--concurrency", "4"]
    )
    assert a.bench_mode == "serve" and math.isinf(a.request_rate) and a.concurrency == 4
    a = p.parse_args(["bench", "offline", "--num-prompts", "3", "--max-num-seqs", "8", "--dtype", "float32"])
    assert a.bench_mode == "offline" and a.model == "demo" and a.max_num_seqs == 8
    with pytest.raises(SystemExit):
        p.parse_args(["bench", "serve", "--request-rate", "0"])


def test_bench_module_imports_neither_torch_nor_matplotlib() -> None:
    code = (
        "import sys, hybridserve.bench, hybridserve.benchmarks.serve_client, hybridserve.benchmarks.plots; "
        "print('torch' in sys.modules, 'matplotlib' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_workloads_do_not_share_tokens_across_names() -> None:
    a = build_workload(WorkloadSpec(name="random", num_requests=1, prompt_len=64))[0].prompts[0]
    b = build_workload(WorkloadSpec(name="shared-prefix", num_requests=1, prompt_len=64))[0].prompts[0]
    assert a[:16] != b[:16]


def test_bench_offline_counts_the_tokens_made_and_says_when_they_are_fewer() -> None:
    from hybridserve.benchmarks.offline import format_offline, run_offline
    from hybridserve.config import EngineArgs

    r = run_offline(EngineArgs(model="demo", max_num_seqs=4), 3, 20, 6, warmup=False)
    assert r["total_output_tokens"] == 18 and [len(o) for o in r["outputs"]] == [6, 6, 6]
    assert r["total_prompt_tokens"] == 60 and "note:" not in format_offline(r)
    # prompt + output past max_model_len: each request ends there (10 tokens, not 30)
    r = run_offline(EngineArgs(model="demo", max_num_seqs=4, max_model_len=30), 3, 20, 30, warmup=False)
    assert r["total_output_tokens"] == 30 and r["max_model_len"] == 30
    assert math.isclose(r["output_throughput"], 30 / r["elapsed_s"])
    assert "note: 30 output tokens made of the 90 asked" in format_offline(r)


def test_bench_offline_full_warmup_runs_the_workload_first_and_counts_only_the_timed_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the whole workload run once before, the timed run has the same outputs, its own step
    count and speculation counters, and no prefix hit from the warm-up: the cache is emptied (the
    prompts are long enough to reach a grid checkpoint, so a repeat would hit it)."""
    from hybridserve.benchmarks.offline import run_offline
    from hybridserve.config import EngineArgs
    from hybridserve.engine.llm_engine import LLMEngine

    spec = {"method": "ngram", "num_speculative_tokens": 3}
    args = EngineArgs(
        model="demo", max_num_seqs=4, speculative_config=spec, mamba_checkpoint_placement="branch+grid"
    )
    cold = run_offline(args, 3, 300, 6, warmup="none")
    warm = run_offline(args, 3, 300, 6, warmup="full")
    assert warm["outputs"] == cold["outputs"] and warm["config"]["warmup"] == "full"
    assert warm["num_steps"] == cold["num_steps"]
    assert warm["spec_decode_draft_tokens"] == cold["spec_decode_draft_tokens"]
    assert warm["prefix_cache_hit_tokens"] == cold["prefix_cache_hit_tokens"] == 0
    # not vacuous: without the emptying, the timed run hits the warm-up's grid checkpoints
    monkeypatch.setattr(LLMEngine, "reset_prefix_cache", lambda self: True)
    assert run_offline(args, 3, 300, 6, warmup="full")["prefix_cache_hit_tokens"] > 0


def test_multi_turn_prompts_take_the_real_answers_where_given() -> None:
    spec = WorkloadSpec(name="multi-turn", num_requests=3, prompt_len=6, max_tokens=2, num_turns=3)
    (conv,) = build_workload(spec)
    m, st = conv.messages, conv.stand_ins
    assert [len(x) for x in m] == [6, 6, 6] and [len(x) for x in st] == [2, 2]
    assert [conv.prompt(t) for t in range(3)] == conv.prompts
    assert conv.prompts[2] == m[0] + st[0] + m[1] + st[1] + m[2]
    # an answer of any length replaces its stand-in; None keeps the stand-in
    assert conv.prompt(2, [[9, 9, 9], None]) == m[0] + [9, 9, 9] + m[1] + st[1] + m[2]
    assert conv.prompt(1, [[9]]) == m[0] + [9] + m[1]
    single = build_workload(WorkloadSpec(name="random", num_requests=1, prompt_len=5))[0]
    assert single.prompt(0, [[1]]) == single.prompts[0]


def _serve_args(*extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "serve", *extra])


def test_trace_flags() -> None:
    from hybridserve.bench import _load_trace
    from hybridserve.benchmarks.traces import generate
    from hybridserve.errors import ConfigError

    trace, source = _load_trace(_serve_args("--workload", "trace", "--trace", "t2", "--trace-scale", "0.05",
                                            "--trace-seed", "4", "--token-id-max", "100"))  # fmt: skip
    assert trace == generate("T2", seed=4, scale=0.05, token_id_max=100)
    assert source == "T2 seed=4 scale=0.05"
    assert _load_trace(_serve_args("--workload", "random")) == (None, None)
    a = _serve_args("--workload", "trace", "--trace", "T1")
    assert (a.trace_seed, a.trace_scale, a.trace_time_scale) == (None, None, None)  # (1 when not given)
    for bad, msg in (
        (["--workload", "trace"], "needs --trace"),
        (["--trace", "T1"], "--trace needs --workload trace"),
        (["--trace-scale", "2"], "--trace-scale needs --workload trace"),
        (["--trace-time-scale", "0.5"], "--trace-time-scale needs --workload trace"),
        (["--workload", "trace", "--trace", "some.jsonl", "--trace-seed", "1"], "apply to a generated trace"),
        (["--workload", "trace", "--trace", "/nonexistent/t.jsonl"], "cannot read"),
    ):
        with pytest.raises(ConfigError, match=msg):
            _load_trace(_serve_args(*bad))
    for flag, value in (("--trace-scale", "0"), ("--trace-time-scale", "-1"), ("--trace-seed", "-1"),
                        ("--seed", "-1"), ("--temperature", "nan"), ("--temperature", "-0.5")):  # fmt: skip
        with pytest.raises(SystemExit):
            _serve_args("--workload", "trace", "--trace", "T1", flag, value)


def test_a_trace_refuses_the_sizes_of_a_generated_workload() -> None:
    import math

    from hybridserve.bench import _workload_defaults
    from hybridserve.errors import ConfigError

    for flag, value in (
        ("--num-requests", "1"),
        ("--request-rate", "1"),
        ("--prompt-len", "8"),
        ("--max-tokens", "2"),
    ):
        with pytest.raises(ConfigError, match=f"{flag} does not apply to --workload trace"):
            _workload_defaults(_serve_args("--workload", "trace", "--trace", "T1", flag, value))
    a = _serve_args("--workload", "random", "--max-tokens", "5")
    _workload_defaults(a)
    assert (a.num_requests, a.request_rate, a.prompt_len, a.max_tokens) == (64, math.inf, 256, 5)
    _workload_defaults(_serve_args("--workload", "trace", "--trace", "T1"))  # nothing given: taken


async def _fake_server(aiohttp_server: Any, mode: str, bodies: list[dict]) -> Any:
    """An OpenAI-compatible stand-in: streams `max_tokens` chunks of token 7. `mode`: "ids" returns
    the ids for return_token_ids, "ignore" never returns them, "refuse" answers a request that asks
    for them with a 400 naming the field (as a strict server does with an unknown field). A broken
    server: "empty" streams nothing, "text-count" and "over-cached" send usage that is no usage,
    "abort" and "error" end the answer with that finish_reason (a shutdown, a failure),
    "models-html" / "models-no-id" answer /v1/models with no model list."""
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        if mode == "refuse" and "return_token_ids" in body:
            err = {"message": "unknown field 'return_token_ids'", "param": "return_token_ids"}
            return web.json_response({"error": err}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if mode == "empty":
            return resp
        n = body["max_tokens"]
        for i in range(n):
            choice: dict[str, Any] = {
                "index": 0,
                "text": "x",
                "finish_reason": ("length" if mode not in ("abort", "error") else mode)
                if i == n - 1
                else None,
            }
            if mode == "ids" and body.get("return_token_ids"):
                choice["token_ids"] = [7]
            await resp.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                 "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
        if mode == "text-count":
            usage["completion_tokens"] = "a"
        if mode == "over-cached":
            usage["prompt_tokens_details"] = {"cached_tokens": len(body["prompt"]) + 5}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(request: web.Request) -> web.Response:
        if mode == "models-html":
            return web.Response(text="<html>nope</html>", content_type="text/html")
        if mode == "models-no-id":
            return web.json_response({"data": [{"name": "fake"}]})
        return web.json_response({"data": [{"id": "fake"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    return await aiohttp_server(app)


@pytest.mark.parametrize("mode", ["ids", "ignore", "refuse"])
async def test_follow_ups_use_the_returned_ids_or_fall_back_to_stand_ins(
    aiohttp_server: Any, mode: str
) -> None:
    from hybridserve.benchmarks.serve_client import ServeConfig, run_serve

    bodies: list[dict] = []
    srv = await _fake_server(aiohttp_server, mode, bodies)
    spec = WorkloadSpec(name="multi-turn", num_requests=4, prompt_len=5, max_tokens=3, num_turns=2)
    cfg = ServeConfig(
        base_url=str(srv.make_url("")).rstrip("/"), workload=spec, concurrency=1, progress=False
    )
    r = await run_serve(cfg)
    assert r["summary"]["completed"] == 4
    real = mode == "ids"
    fu = r["summary"]["follow_ups"]
    assert (fu["requests"], fu["real_answers"], fu["stand_in_answers"]) == (2, 2 * real, 2 * (not real))
    assert fu["return_token_ids_refused"] is (mode == "refuse")
    assert [q["prompt_answers"] for q in r["requests"]] == [None, "real" if real else "stand-in"] * 2
    sent = [b["prompt"] for b in bodies if not (mode == "refuse" and "return_token_ids" in b)]
    convs = build_workload(spec)
    want = [c.prompt(t, [[7, 7, 7]] if real else []) for c in convs for t in range(2)]
    assert sorted(sent) == sorted(want)  # (the two conversations run side by side)
    # ids are asked for until the server refuses them: then once more without, and never again
    asked = ["return_token_ids" in b for b in bodies]
    assert asked == ([True, False, False, False, False] if mode == "refuse" else [True] * 4)


@pytest.mark.parametrize(
    ("mode", "error"),
    [
        ("empty", "the stream ended without a chunk of the answer"),
        ("text-count", "the server's usage.completion_tokens is not a count: 'a'"),
        ("over-cached", "the server's usage says 8 cached of 3 prompt tokens"),
        ("abort", "the server ended the request with finish_reason 'abort'"),
        ("error", "the server ended the request with finish_reason 'error'"),
    ],
)
async def test_a_broken_answer_fails_its_request_saying_why(
    aiohttp_server: Any, mode: str, error: str
) -> None:
    from hybridserve.benchmarks.serve_client import ServeConfig, run_serve

    srv = await _fake_server(aiohttp_server, mode, [])
    spec = WorkloadSpec(name="random", num_requests=2, prompt_len=3, max_tokens=2)
    cfg = ServeConfig(base_url=str(srv.make_url("")).rstrip("/"), workload=spec, progress=False)
    r = await run_serve(cfg)
    assert (r["summary"]["completed"], r["summary"]["failed"]) == (0, 2)
    assert [q["error"] for q in r["requests"]] == [error, error]


@pytest.mark.parametrize("mode", ["models-html", "models-no-id"])
async def test_a_model_list_without_an_id_is_a_one_line_error(aiohttp_server: Any, mode: str) -> None:
    from hybridserve.benchmarks.serve_client import ServeConfig, run_serve

    srv = await _fake_server(aiohttp_server, mode, [])
    spec = WorkloadSpec(name="random", num_requests=1, prompt_len=3, max_tokens=2)
    cfg = ServeConfig(base_url=str(srv.make_url("")).rstrip("/"), workload=spec, progress=False)
    with pytest.raises(RuntimeError, match="gives no model list with an id"):
        await run_serve(cfg)


def test_a_flag_of_another_workload_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from hybridserve.cli import main

    for flags, said in (
        (
            ["--workload", "random", "--num-turns", "5"],
            "--num-turns applies to --workload multi-turn, not random",
        ),
        (
            ["--workload", "multi-turn", "--prefix-len", "16"],
            "--prefix-len applies to --workload shared-prefix",
        ),
        (
            ["--workload", "random", "--num-prefixes", "3"],
            "--num-prefixes applies to --workload shared-prefix",
        ),
    ):
        assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", *flags]) == 2
        assert said in capsys.readouterr().err


def test_a_shared_prefix_as_long_as_the_prompt_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """(one of the prompt's length would leave no token of its own: it was cut without a word)"""
    from hybridserve.cli import main

    for prefix in ("100", "64"):
        argv = ["bench", "serve", "--workload", "shared-prefix", "--prompt-len", "64", "--prefix-len", prefix]
        assert main(argv) == 2
        assert f"--prefix-len {prefix} leaves no unique tokens in --prompt-len 64" in capsys.readouterr().err
