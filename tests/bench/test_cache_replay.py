"""The trace replay of the prefix cache (benchmarks/cache_replay.py): the real scheduler and cache,
the model faked by the trace's outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridserve.bench import bench_main
from hybridserve.benchmarks import cache_replay as cr
from hybridserve.benchmarks.traces import Trace, TraceRequest, chat_template_ids, generate

SHARED = tuple(range(3, 103))  # 100 tokens: 6 whole blocks of 16 (96) and 4 more


def _tokens(seed: int, n: int) -> tuple[int, ...]:
    return tuple(3 + (seed * 7919 + i * 104729) % 250 for i in range(n))


def _sharers() -> Trace:
    """Three prompts sharing 100 tokens, one at a time, then a follow-up turn of the first."""
    reqs = [
        TraceRequest(id=f"s{i}", arrival=float(i), prompt=SHARED + _tokens(i, 40), output=_tokens(50 + i, 6))
        for i in range(3)
    ]
    reqs.append(
        TraceRequest(id="s0-next", after="s0", think_time=5.0, prompt_append=_tokens(99, 9), output=(7, 8))
    )
    return Trace("sharers", tuple(reqs))


def _hits(trace: Trace, policy: str, spec: bool = False) -> list[int]:
    r = cr.replay(trace, cr.Cell(cr.POLICIES[policy], 10.0, speculation=spec, max_num_seqs=4))
    assert r.requests == len(trace.requests)
    return [r.hit_tokens, r.hits_by_kind["branch"], r.hits_by_kind["last_token"], r.hits_by_kind["grid"]]


def test_hits_land_where_the_placement_puts_checkpoints() -> None:
    t = _sharers()
    turn = 140 + 6 - 1  # the first request's prompt + output, but for the last output token
    # branch points and last tokens: the 2nd sharer keeps the state at 96, the 3rd hits it; the
    # next turn resumes at the first request's last computed token
    assert _hits(t, "hybridserve") == [96 + turn, 1, 1, 0]
    assert _hits(t, "hybridserve", spec=True) == [96 + turn, 1, 1, 0]
    # a 256-token grid has no point inside 100 or 140 tokens
    assert _hits(t, "grid-lru") == [0, 0, 0, 0]
    # every block boundary kept: the 2nd and 3rd sharers hit 96, the next turn its whole prefix
    oracle = cr.replay(t, cr.Cell(cr.POLICIES["oracle"], 0.0, max_num_seqs=4))
    assert oracle.hit_tokens == 96 + 96 + turn


def test_a_system_prompt_is_hit_by_its_second_user_when_its_first_declares_it() -> None:
    """Chat prompts: a 100-token system prompt, then [END_OF_TURN, USER] and a user message. The
    engine's defaults declare the prompt up to its first END_OF_TURN shared: the first user keeps
    the state at 96 and the second already hits it. With branch points alone the second user only
    finds the branch point (and keeps it for the third)."""
    eot, user, assistant = chat_template_ids()
    system = tuple(6 + i % 200 for i in range(100))

    def message(i: int) -> tuple[int, ...]:
        return (eot, user, *(6 + (i * 31 + j) % 200 for j in range(30 + i)), eot, assistant)

    reqs = [
        TraceRequest(id=f"u{i}", arrival=float(i), prompt=system + message(i), output=(7, 8))
        for i in range(3)
    ]
    t = Trace("system", tuple(reqs))
    new = cr.replay(t, cr.Cell(cr.POLICIES["hybridserve"], 10.0, max_num_seqs=4))
    assert (new.hit_tokens, new.hits_by_kind["declared"], new.hits_by_kind["branch"]) == (96 + 96, 2, 0)
    sglang = cr.replay(t, cr.Cell(cr.POLICIES["sglang-like"], 10.0, max_num_seqs=4))
    assert (sglang.hit_tokens, sglang.hits_by_kind["declared"], sglang.hits_by_kind["branch"]) == (96, 0, 1)
    # without markers the engine's defaults find the branch point like sglang-like
    cell = cr.Cell(cr.POLICIES["hybridserve"], 10.0, max_num_seqs=4, shared_prefix_markers=())
    assert cr.replay(t, cell).hit_tokens == 96


def test_replay_is_deterministic_and_bounded_by_the_oracle() -> None:
    trace = generate("T2", seed=3, scale=0.1)
    cell = cr.Cell(cr.POLICIES["hybridserve"], 1.5, max_num_seqs=8)
    a, b = cr.replay(trace, cell), cr.replay(trace, cell)
    assert a.to_dict() | {"wall_s": 0} == b.to_dict() | {"wall_s": 0}
    assert a.requests == len(trace.requests) and 0 < a.hit_rate < 1
    oracle = cr.replay(trace, cr.Cell(cr.POLICIES["oracle"], 0.0, max_num_seqs=8))
    for name in ("grid-lru", "sglang-like", "hybridserve"):
        r = cr.replay(trace, cr.Cell(cr.POLICIES[name], 1.5, max_num_seqs=8))
        assert r.hit_tokens <= oracle.hit_tokens, name
        assert r.flops_saved <= r.prefill_flops
    # a tight pool evicts, and says why
    assert a.evictions["checkpoint"] > 0
    assert sum(a.evictions[k] for k in ("checkpoint_stale", "checkpoint_for_checkpoint",
                                        "checkpoint_for_window", "checkpoint_for_kv")) == a.evictions["checkpoint"]  # fmt: skip


def test_a_budget_beyond_everything_is_the_oracles_pools_and_changes_nothing() -> None:
    """Pools that hold everything ever computed never evict: a budget stops there, instead of
    allocating gigabytes in the scheduler or overflowing its sizes (1e300)."""
    t = _sharers()
    oracle = cr.Cell(cr.POLICIES["oracle"], 0.0, max_num_seqs=4)
    kv, slots, _ = cr._pool_sizes(t, oracle, 0)
    for budget in (1e6, 1e300, 1.7e308):
        assert cr._pool_sizes(t, cr.Cell(cr.POLICIES["hybridserve"], budget, max_num_seqs=4), 0)[:2] == (
            kv,
            slots,
        )
    huge = cr.replay(t, cr.Cell(cr.POLICIES["hybridserve"], 1e300, max_num_seqs=4))
    ample = cr.replay(t, cr.Cell(cr.POLICIES["hybridserve"], 10.0, max_num_seqs=4))
    assert huge.hit_tokens == ample.hit_tokens and huge.evictions == ample.evictions


def test_a_huge_max_num_seqs_is_a_usage_error_and_workers_stop_at_the_cells(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from hybridserve.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", "cache-trace", "--max-num-seqs", "9" * 23])
    assert e.value.code == 2 and "--max-num-seqs: must be in [1, 65536]" in capsys.readouterr().err
    # one cell: it runs here, not in a pool of 10**9 processes
    cell = cr.Cell(cr.POLICIES["hybridserve"], 10.0, max_num_seqs=4)
    assert cr.run_cells([_sharers()], [cell], workers=10**9)[0].requests == 4


def test_experiment_report_has_every_cell() -> None:
    trace = generate("T4", seed=1, scale=0.05)
    exp = cr.Experiment(traces=(trace,), budgets=(3.0,), policies=("oracle", "sglang-like", "hybridserve"))
    results = cr.run_experiment(exp)
    assert [r.policy for r in results] == ["oracle", "sglang-like", "hybridserve"]
    text = cr.report(results)
    assert "| T4 x0.05 | 3x | auto | off |" in text
    assert "hybridserve / sglang-like" in text


def test_serve_comparison_tables_show_a_run_without_results_as_na() -> None:
    """benches/cache_trace_serve.py: a configuration whose requests all failed has no hit rate
    and no TTFT; formatting None ended the script before it wrote its result file."""
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("cache_trace_serve", root / "benches/cache_trace_serve.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    t = _sharers()
    row = {"repeat": 0, "trace": t.name, "replay_hit_rate": 0.5, "ttft_by_reuse": {}}
    rows = [
        {
            **row,
            "config": "grid",
            "hit_rate": None,
            "ttft_p50_ms": None,
            "ttft_p95_ms": None,
            "ttft_p99_ms": None,
        },
        {
            **row,
            "config": "default",
            "hit_rate": 0.25,
            "ttft_p50_ms": 1.0,
            "ttft_p95_ms": 2.0,
            "ttft_p99_ms": 3.0,
        },
    ]
    changes = mod.p95_changes(rows, [t], 1)
    assert changes == {}
    text = mod.tables(rows, changes)
    assert "| 0 | sharers | grid | n/a | 0.500 | n/a / n/a / n/a |" in text
    assert "| 0 | sharers | default | 0.250 | 0.500 | 1.0 / 2.0 / 3.0 |" in text


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hybridserve", "bench", "cache-trace", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_writes_the_report_and_the_cells(tmp_path: Path) -> None:
    p = _cli("--traces", "T1:0.03", "--budgets", "2", "--policies", "oracle,hybridserve",
             "--result-file", str(tmp_path / "r.json"), "--report", str(tmp_path / "r.md"))  # fmt: skip
    assert p.returncode == 0, p.stderr
    cells = json.loads((tmp_path / "r.json").read_text())["cells"]
    assert {c["policy"] for c in cells} == {"oracle", "hybridserve"}
    assert all(0.0 <= c["hit_rate"] <= 1.0 for c in cells)
    assert "Token hit rate" in (tmp_path / "r.md").read_text()


def test_cli_names_the_line_of_a_malformed_trace(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"id": "a", "arrival": 0, "prompt": [5, 6], "output": [7]}\n\n{"id": "b", "prompt": [1]}\n'
    )
    p = _cli("--trace-file", str(bad))
    assert p.returncode == 2
    assert f"{bad}:3:" in p.stderr and "Traceback" not in p.stderr


def test_cli_refuses_two_traces_of_one_name(tmp_path: Path) -> None:
    """Results are kept by trace name: two files x.jsonl in two folders were one row of the
    report, the other's results dropped."""
    from hybridserve.benchmarks.traces import write_trace
    from hybridserve.cli import build_parser
    from hybridserve.errors import ConfigError

    paths = [tmp_path / d / "x.jsonl" for d in ("a", "b")]
    for path, t in zip(paths, (_sharers(), generate("T2", scale=0.02))):
        path.parent.mkdir()
        write_trace(Trace("x", t.requests), path)
    args = build_parser().parse_args(
        ["bench", "cache-trace", "--trace-file", str(paths[0]), "--trace-file", str(paths[1])]
    )
    with pytest.raises(
        ConfigError, match=f"--trace-file {paths[1]}: its trace is named 'x', as --trace-file {paths[0]}"
    ):
        bench_main(args)


@pytest.mark.parametrize(
    ("flag", "value"), [("--policies", "fifo"), ("--modes", "sometimes"), ("--speculation", "eagle")]
)
def test_cli_refuses_unknown_names(flag: str, value: str) -> None:
    p = _cli("--traces", "T1:0.01", flag, value)
    assert p.returncode == 2 and flag in p.stderr and "Traceback" not in p.stderr


def test_cli_refuses_the_oracle_alone_and_runs_a_repeated_name_once(tmp_path: Path) -> None:
    p = _cli("--traces", "T1:0.01", "--policies", "oracle,oracle")
    assert p.returncode == 2 and "--policies: the oracle is what the others are measured against" in p.stderr
    p = _cli("--traces", "T1:0.03,T1:0.03", "--budgets", "2,2", "--policies", "hybridserve,oracle,hybridserve",
             "--result-file", str(tmp_path / "r.json"))  # fmt: skip
    assert p.returncode == 0, p.stderr
    cells = json.loads((tmp_path / "r.json").read_text())["cells"]
    assert sorted(c["policy"] for c in cells) == ["hybridserve", "oracle"]
