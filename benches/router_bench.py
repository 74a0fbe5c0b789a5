"""Two replicas behind vllm-router (cache-aware, round-robin) vs one replica alone: prefix-cache hit
rate and throughput of `hybridserve bench serve` workloads.

    .venv/bin/python benches/router_bench.py [--workloads shared-prefix,multi-turn] [--num-requests 128]
        [--request-rate inf] [--concurrency 16] [--router-bin .venv-router/bin/vllm-router]

For each workload and each setup, fresh processes: `hybridserve serve demo --cpu-threads 1` alone,
or `hybridserve replicas --num-replicas 2 --policy POLICY -- demo --cpu-threads 1`; the load
generator (`hybridserve bench serve`) against it; then the hit rate as the sum over the replicas'
/metrics of hit tokens over queried tokens (the load generator's own /metrics reading would see
one replica through the router). Results: benches/results/router_<workload>_<setup>.json and
router_summary.json; the table is printed as markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benches" / "results"
sys.path.insert(0, str(ROOT / "benches"))

from server_process import free_port, parse_metrics  # noqa: E402

# The shared-prefix workload cycles through its groups in order: with an even number of groups and
# two replicas, round-robin would send each group to one replica by coincidence, so an odd number.
SHAPES = {
    "shared-prefix": shlex.split("--prompt-len 512 --prefix-len 384 --num-prefixes 15 --max-tokens 32"),
    "multi-turn": shlex.split("--prompt-len 128 --num-turns 4 --max-tokens 32"),
}
SETUPS = ("single", "cache_aware", "round_robin")
SERVE = ["demo", "--cpu-threads", "1"]


def _get(url: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as e:
        return int(e.code), ""
    except OSError:
        return 0, ""


def start(setup: str, router_bin: str, log: Path) -> tuple[subprocess.Popen[bytes], str, list[str]]:
    """The setup's processes: (the process to signal, the URL to load, the replicas' URLs)."""
    port = free_port()
    py = [sys.executable, "-m", "hybridserve"]
    if setup == "single":
        cmd = [*py, "serve", *SERVE, "--port", str(port)]
        replicas = [f"http://127.0.0.1:{port}"]
    else:
        first = free_port()
        cmd = [
            *py,
            "replicas",
            "--num-replicas",
            "2",
            "--port",
            str(port),
            "--first-replica-port",
            str(first),
        ]
        cmd += ["--policy", setup, "--router-bin", router_bin, "--router-metrics-port", str(free_port())]
        cmd += ["--log-dir", str(log.parent / f"{setup}-logs"), "--", *SERVE]
        replicas = [f"http://127.0.0.1:{first + i}" for i in range(2)]
    print(f"$ {shlex.join(['hybridserve', *cmd[3:]])}", flush=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while _get(base + "/health")[0] != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{setup} did not start: see {log}")
        time.sleep(0.2)
    return proc, base, replicas


def hits(replicas: list[str]) -> tuple[float, float]:
    ms = [parse_metrics(_get(u + "/metrics")[1]) for u in replicas]
    return (
        sum(m["hybridserve_prefix_cache_hit_tokens_total"] for m in ms),
        sum(m["hybridserve_prefix_cache_queried_tokens_total"] for m in ms),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="shared-prefix,multi-turn")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--request-rate", default="inf")
    ap.add_argument("--concurrency", default="16")
    ap.add_argument("--seed", default="0")
    own = ROOT / ".venv-router" / "bin" / "vllm-router"
    ap.add_argument("--router-bin", default=str(own) if own.exists() else shutil.which("vllm-router"))
    a = ap.parse_args()
    if not a.router_bin:
        sys.exit("no vllm-router: `make router` or --router-bin")
    tmp = RESULTS / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"load_average_before": os.getloadavg(), "runs": {}}
    rows = []
    for wl in [w for w in a.workloads.split(",") if w]:
        for setup in SETUPS:
            proc, base, replicas = start(setup, a.router_bin, tmp / f"router_{setup}.log")
            try:
                result_file = RESULTS / f"router_{wl}_{setup}.json"
                bench = [sys.executable, "-m", "hybridserve", "bench", "serve", "--base-url", base]
                bench += ["--workload", wl, "--num-requests", str(a.num_requests), *SHAPES[wl]]
                bench += ["--request-rate", a.request_rate, "--concurrency", a.concurrency, "--seed", a.seed]
                bench += ["--result-file", str(result_file), "--no-progress"]
                print(f"$ {shlex.join(['hybridserve', *bench[3:]])}", flush=True)
                h0, q0 = hits(replicas)
                subprocess.run(bench, check=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "python")))
                h1, q1 = hits(replicas)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=120)
            s = json.loads(result_file.read_text())["summary"]
            run = {
                "hit_tokens": h1 - h0,
                "queried_tokens": q1 - q0,
                "hit_rate": (h1 - h0) / (q1 - q0),
                "usage_cache_hit_rate": s["usage_cache_hit_rate"],
                "completed": s["completed"],
                "failed": s["failed"],
                "request_throughput": s["request_throughput"],
                "output_throughput": s["output_throughput"],
                "ttft_median_ms": s["ttft"]["median_ms"],
                "e2e_median_ms": s["e2e"]["median_ms"],
            }
            summary["runs"][f"{wl}/{setup}"] = run
            rows.append(
                f"| {wl} | {setup} | {run['completed']}/{a.num_requests} | {run['hit_rate']:.3f} "
                f"({run['hit_tokens']:.0f} / {run['queried_tokens']:.0f}) | {run['usage_cache_hit_rate']:.3f} "
                f"| {run['request_throughput']:.2f} | {run['output_throughput']:.0f} "
                f"| {run['ttft_median_ms']:.0f} | {run['e2e_median_ms']:.0f} |"
            )
    summary["load_average_after"] = os.getloadavg()
    (RESULTS / "router_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(
        "| workload | setup | ok | hit rate (/metrics, hit / queried tokens) | hit rate (usage) "
        "| req/s | output tok/s | TTFT median ms | E2E median ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
