"""`hybridserve bench serve` on every workload against a fresh `hybridserve serve demo`, one command.

    .venv/bin/python benches/serve_bench.py [--num-requests 32] [--request-rate 4] [--concurrency 16]
        [--workloads random,shared-prefix,multi-turn,repetitive] [--server-args "--max-num-seqs 32"]

Starts the server on a free port (subprocess), runs the load generator once per workload (results
in benches/results/serve_<workload>.json, charts in benches/results/charts/), stops the server.
The repetitive workload also runs against a second server with n-gram speculation
(`--speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'`) unless --no-spec.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benches" / "results"
sys.path.insert(0, str(ROOT / "benches"))

from server_process import BenchServer  # noqa: E402

# per workload: prompt length, max tokens, extra workload settings
SHAPES: dict[str, dict[str, Any]] = {
    "random": {"prompt_len": 256, "max_tokens": 64},
    "shared-prefix": {"prompt_len": 512, "max_tokens": 64, "prefix_len": 384},
    "multi-turn": {"prompt_len": 128, "max_tokens": 32, "num_turns": 3},
    "repetitive": {"prompt_len": 256, "max_tokens": 64},
}


def run_workload(base: str, name: str, a: argparse.Namespace, tag: str) -> dict[str, Any]:
    from hybridserve.benchmarks.plots import plot_serve
    from hybridserve.benchmarks.serve_client import ServeConfig, serve_main
    from hybridserve.benchmarks.workloads import WorkloadSpec

    spec = WorkloadSpec(name=name, num_requests=a.num_requests, seed=a.seed, **SHAPES[name])
    cfg = ServeConfig(base_url=base, workload=spec, request_rate=a.request_rate, concurrency=a.concurrency)
    result_file = RESULTS / f"serve_{tag}.json"
    result = serve_main(cfg, str(result_file), None)
    for p in plot_serve(result, RESULTS / "charts", prefix=f"serve_{tag}"):
        print(f"chart: {p.relative_to(ROOT)}")
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--request-rate", type=float, default=4.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workloads", default="random,shared-prefix,multi-turn,repetitive")
    ap.add_argument("--server-args", default="", help="extra `hybridserve serve` flags")
    ap.add_argument(
        "--server-threads", type=int, default=0, help="OMP_NUM_THREADS of the server (default: inherit)"
    )
    ap.add_argument(
        "--no-spec", action="store_true", help="skip the n-gram server for the repetitive workload"
    )
    a = ap.parse_args()
    (RESULTS / "tmp").mkdir(parents=True, exist_ok=True)
    names = [w for w in a.workloads.split(",") if w]
    summary: dict[str, Any] = {
        "load_average_before": os.getloadavg(),
        "server_threads": a.server_threads or None,
    }
    servers: list[tuple[str, list[str], list[str]]] = [("", shlex.split(a.server_args), names)]
    if not a.no_spec and "repetitive" in names:
        spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
        servers.append(
            ("_ngram", [*shlex.split(a.server_args), "--speculative-config", spec], ["repetitive"])
        )
    for suffix, extra, wls in servers:
        srv = BenchServer(extra, RESULTS / "tmp" / f"server{suffix}.log", a.server_threads)
        print(f"server: {shlex.join(srv.cmd[1:])}", flush=True)
        try:
            srv.wait_ready()
            for name in wls:
                r = run_workload(srv.base, name, a, f"{name}{suffix}")
                summary[f"{name}{suffix}"] = r["summary"]
        finally:
            srv.stop()
    summary["load_average_after"] = os.getloadavg()
    (RESULTS / "serve_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
