"""Pieces of the benchmark client that need no server: workloads, statistics, /metrics parsing, CLI."""

from __future__ import annotations

import math
import subprocess
import sys

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
