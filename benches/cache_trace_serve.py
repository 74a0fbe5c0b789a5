"""Request traces through the real HTTP server, checkpoint placements side by side, in one run.

    .venv/bin/python benches/cache_trace_serve.py [--traces T1:0.5,T2:0.5] [--time-scale 1]
        [--server-args "..."] [--result-file benches/results/cache_trace_serve.json]

For each configuration (`grid`: a checkpoint every mamba_block_size tokens with LRU eviction, the
grid baseline; `default`: the engine's defaults, branch points, declared shared prefixes, last tokens and grid points
in spare room with FLOP-aware eviction), a `hybridserve serve demo` (or `--model DIR`) subprocess is started and every trace is replayed through it
with `bench serve --workload trace` (follow-up turns built from the server's real answers). Per
trace and configuration: the token hit rate the requests saw (`cached_tokens`), TTFT p50 / p95 /
p99, and the hit rate of the model-free replay (`hybridserve bench cache-trace`'s engine) of the
same trace with the same pool sizes, for comparison.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

sys.path.insert(0, str(ROOT / "benches"))

from hybridserve.benchmarks import cache_replay as cr  # noqa: E402
from hybridserve.benchmarks.serve_client import ServeConfig, percentile, serve_main  # noqa: E402
from hybridserve.benchmarks.traces import chat_template_ids, generate  # noqa: E402
from hybridserve.benchmarks.workloads import WorkloadSpec  # noqa: E402
from server_process import BenchServer  # noqa: E402

# server flags, and the same cache policy for the replay
CONFIGS = {
    "grid": ["--mamba-checkpoint-placement", "grid", "--prefix-cache-eviction", "lru"],
    # the defaults; the generated traces end a message with their own END_OF_TURN id, which the
    # server takes as its shared-prefix marker as it would take its chat template's
    "default": ["--shared-prefix-markers", str(chat_template_ids()[0])],
}
POLICIES = {
    "grid": cr.Policy("grid", "grid", "lru", 256),
    "default": cr.POLICIES["hybridserve"],
}


GROUPS = ("1st", "2nd", "3rd+", "follow-up")


def model_shape(model_dir: str) -> cr.CostShape:
    """The cost numbers the server weighs a checkpoint folder's states by, for the replay."""
    from hybridserve.model.model_config import read_config_json

    return cr.CostShape.from_config(
        Path(model_dir).name, read_config_json(str(Path(model_dir) / "config.json"))
    )


def reuse_order(trace: Any) -> dict[str, str]:
    """Each request's place among the requests whose prompt starts like its own (the same first
    16 tokens: one system prompt in T1), by arrival: "1st" (nothing earlier to hit), "2nd" (the
    first reuse, where no placement that waits for a second sharer has kept a state at the
    shared prefix's end yet), "3rd+"; "follow-up" for later turns of a conversation."""
    groups: dict[tuple[int, ...], int] = {}
    order: dict[str, str] = {}
    firsts = sorted((r for r in trace.requests if r.prompt is not None), key=lambda r: (r.arrival, r.id))
    for r in firsts:
        key = tuple(r.prompt[:16])
        seen = groups.get(key, 0)
        groups[key] = seen + 1
        order[r.id] = ("1st", "2nd")[seen] if seen < 2 else "3rd+"
    for r in trace.requests:
        order.setdefault(r.id, "follow-up")
    return order


def ttft_by_reuse(trace: Any, records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """TTFT of the completed requests by `reuse_order` group: count, share, p50 / p95 (ms)."""
    order = reuse_order(trace)
    by: dict[str, list[float]] = {}
    for rec in records:
        if rec.get("error") is None and rec.get("ttft_ms") is not None:
            by.setdefault(order.get(str(rec.get("id")), "?"), []).append(float(rec["ttft_ms"]))
    total = sum(len(v) for v in by.values()) or 1
    return {
        group: {
            "n": len(v),
            "share": len(v) / total,
            "ttft_p50_ms": percentile(v, 50),
            "ttft_p95_ms": percentile(v, 95),
        }
        for group, v in sorted(by.items())
    }


def _num(v: float | None, fmt: str = ".1f") -> str:
    """A number of the tables, "n/a" where a run measured none (every request failed)."""
    return "n/a" if v is None else format(v, fmt)


def p95_changes(rows: list[dict[str, Any]], traces: list[Any], repeats: int) -> dict[str, list[float]]:
    """Per trace, each repeat's P95 TTFT change of `default` against `grid`, in percent (a repeat
    where either measured none is left out)."""
    by = {(r["repeat"], r["trace"], r["config"]): r for r in rows}
    changes: dict[str, list[float]] = {}
    for t in traces:
        for rep in range(repeats):
            g, b = by.get((rep, t.name, "grid")), by.get((rep, t.name, "default"))
            if g and b and g["ttft_p95_ms"] and b["ttft_p95_ms"] is not None:
                changes.setdefault(t.name, []).append(100 * (b["ttft_p95_ms"] / g["ttft_p95_ms"] - 1))
    return changes


def tables(rows: list[dict[str, Any]], changes: dict[str, list[float]]) -> str:
    """The markdown tables of a run. A row of a run whose requests all failed has no hit rate and
    no TTFT: "n/a" (formatting None ended the script before it wrote its result file)."""
    lines = [
        "",
        "| repeat | trace | config | hit rate (server) | hit rate (replay) | TTFT p50 / p95 / p99 ms |",
    ]
    lines.append("|---|---|---|---|---|---|")
    for r in rows:
        ms = " / ".join(_num(r[k]) for k in ("ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms"))
        lines.append(
            f"| {r['repeat']} | {r['trace']} | {r['config']} | {_num(r['hit_rate'], '.3f')} | "
            f"{_num(r['replay_hit_rate'], '.3f')} | {ms} |"
        )
    lines += ["", "TTFT by the request's place among those sharing its prompt's start (p50 / p95 ms):"]
    lines.append("| trace | config | " + " | ".join(GROUPS) + " |")
    lines.append("|---|---|" + "---|" * len(GROUPS))
    for r in rows:
        cells = []
        for group in GROUPS:
            g = r["ttft_by_reuse"].get(group)
            cells.append(
                ""
                if g is None
                else f"{g['n']} ({100 * g['share']:.0f}%): {g['ttft_p50_ms']:.1f} / {g['ttft_p95_ms']:.1f}"
            )
        lines.append(f"| {r['trace']} | {r['config']} | " + " | ".join(cells) + " |")
    for name, each in changes.items():
        pct = ", ".join(f"{c:+.0f}%" for c in each)
        lines.append(f"{name}: P95 TTFT default vs grid {pct} (median {statistics.median(each):+.0f}%)")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default="T1:0.5,T2:0.5", help="KIND:SCALE, comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-scale", type=float, default=1.0, help="scales arrivals and think times")
    ap.add_argument("--configs", default="grid,default")
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=256,
        help="the servers' step budget (also the replay's): a prefill takes one step per this many "
        "uncached tokens, so TTFT follows the prefill work as with a model whose layers cost more "
        "than the demo model's",
    )
    ap.add_argument(
        "--server-args",
        default="--max-num-seqs 32 --max-model-len 4096 --dtype float32 --cpu-threads 1",
        help="more flags for every server",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of every trace x configuration; the configurations take turns on each trace, so "
        "that the machine's drift falls on both, and the summary gives each repeat's P95 change "
        "and their median",
    )
    ap.add_argument(
        "--model",
        default="demo",
        help="what the servers serve: the demo model or a checkpoint folder with the demo's tokenizer "
        "(benches/wide_demo.py writes one whose layers cost more)",
    )
    ap.add_argument("--result-file", default=str(ROOT / "benches/results/cache_trace_serve.json"))
    a = ap.parse_args()
    shape = cr.demo_shape() if a.model == "demo" else model_shape(a.model)
    traces = []
    for item in a.traces.split(","):
        kind, _, scale = item.partition(":")
        traces.append(generate(kind, seed=a.seed, scale=float(scale or 1)))
    rows: list[dict[str, Any]] = []
    runs = [
        (rep, trace, name) for rep in range(a.repeats) for trace in traces for name in a.configs.split(",")
    ]
    for rep, trace, name in runs:
        args = shlex.split(a.server_args) + ["--max-num-batched-tokens", str(a.max_num_batched_tokens)]
        args += CONFIGS[name]
        # a fresh server per trace: the caches start empty, as in the replay
        server = BenchServer(
            args, Path(tempfile.gettempdir()) / f"cache_trace_serve_{name}.log", threads=1, model=a.model
        )
        try:
            server.wait_ready()
            before = server.metrics()
            cfg = ServeConfig(
                base_url=server.base,
                workload=WorkloadSpec(name="trace", num_requests=len(trace.requests)),
                progress=False,
                trace=trace,
                trace_source=trace.name,
                trace_time_scale=a.time_scale,
            )
            t0 = time.monotonic()
            result = serve_main(cfg, None, None)
            wall = time.monotonic() - t0
            after = server.metrics()
        finally:
            server.stop()
        summary = result["summary"]["trace"]
        kv = int(after.get("hybridserve_kv_blocks_total", 0)) + 1
        slots = int(after.get("hybridserve_mamba_slots_total", 0)) + 1
        seqs = int(after["hybridserve_max_num_seqs"])  # (what --server-args gave, or the sized default)
        replayed = cr.replay(
            trace,
            cr.Cell(
                POLICIES[name],
                0.0,
                max_num_seqs=seqs,
                max_num_batched_tokens=a.max_num_batched_tokens,
                num_kv_blocks=kv,
                num_mamba_slots=slots,
            ),
            shape,
        )
        failed = result["summary"]["failed"]
        rows.append(
            {
                "config": name,
                "trace": trace.name,
                "repeat": rep,
                "requests": len(trace.requests),
                "failed": failed,
                "hit_rate": summary["token_hit_rate"],
                "replay_hit_rate": replayed.hit_rate,
                "ttft_p50_ms": summary["ttft_p50_ms"],
                "ttft_p95_ms": summary["ttft_p95_ms"],
                "ttft_p99_ms": summary["ttft_p99_ms"],
                "wall_s": wall,
                "server_hit_tokens": after.get("hybridserve_prefix_cache_hit_tokens_total", 0)
                - before.get("hybridserve_prefix_cache_hit_tokens_total", 0),
                "ttft_by_reuse": ttft_by_reuse(trace, result["requests"]),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    # (the file first: a table that cannot be printed must not lose a run of many minutes)
    changes = p95_changes(rows, traces, a.repeats)
    Path(a.result_file).write_text(
        json.dumps({"args": vars(a), "rows": rows, "p95_change_pct": changes}, indent=1)
    )
    print(tables(rows, changes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
