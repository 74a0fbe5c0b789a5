"""Overlapped steps against synchronous ones, on the same work, interleaved, in one run.

    .venv/bin/python benches/overlapped_steps.py [--batch 1,8,64] [--repeats 3] [--no-server]
        [--server-requests 128] [--server-concurrency 64] [--result-file F]

With overlapped steps (`async_scheduling=True`, `--async-scheduling`) a step of decode rows
computes on the C++ library's background thread while the engine thread builds the previous
step's outputs (docs/architecture.md, "Overlapped steps"). Three settings: synchronous steps;
overlapped steps each scheduled after the update of the one before (`HYBRIDSERVE_PLAN_AHEAD=0`,
the server's default); overlapped steps planned while the one before computes
(`HYBRIDSERVE_PLAN_AHEAD=1`, the offline default). All compute with one thread (`cpu_threads=1`);
the overlapped ones also use the engine thread's core while a step computes.

1. Offline, in this process: `LLM("demo", dtype="float32", cpu_threads=1, max_num_seqs=B,
   async_scheduling=False | True)` (each setting in turn), B prompts of `prompt-len` random token ids, greedy, exactly
   `output-len` tokens each, one engine at a time (each repeat builds a fresh engine per setting,
   warms it up and runs it twice); prompt + output tokens per second over the whole run (fastest of
   the repeats), and the process CPU time per run (the overlapped engine's waits poll a core). Greedy
   outputs are checked identical.
2. Through the server, streaming: for each repeat, a fresh `hybridserve serve demo --dtype float32
   --cpu-threads 1 --max-num-seqs 64` with `--no-async-scheduling`, then with
   `--async-scheduling` (without and with steps planned ahead), each driven by `hybridserve bench serve`'s load generator (in this
   process, on the same two cores) with `--server-requests` requests of `prompt-len` random token
   ids and `output-len` output tokens, at most `--server-concurrency` in flight, all at once; output
   tokens per second, TPOT and ITL (fastest / median of the repeats).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "benches"))

from server_process import BenchServer  # noqa: E402

# name: (overlapped steps, steps planned ahead)
MODES = {"sync": (False, False), "unplanned": (True, False), "planned": (True, True)}


@contextlib.contextmanager
def planning(on: bool) -> Iterator[None]:
    """`HYBRIDSERVE_PLAN_AHEAD` for the engines (and servers) made inside the block."""
    saved = os.environ.get("HYBRIDSERVE_PLAN_AHEAD")
    os.environ["HYBRIDSERVE_PLAN_AHEAD"] = "1" if on else "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("HYBRIDSERVE_PLAN_AHEAD", None)
        else:
            os.environ["HYBRIDSERVE_PLAN_AHEAD"] = saved


def make_offline(batch: int, p: int, g: int, mode: tuple[bool, bool]) -> Any:
    from hybridserve import LLM, SamplingParams

    rng = random.Random(batch)
    prompts = [[rng.randrange(100, 700) for _ in range(p)] for _ in range(batch)]
    overlapped, planned = mode
    with planning(planned):
        llm = LLM("demo", dtype="float32", cpu_threads=1, max_num_seqs=batch, async_scheduling=overlapped)
    params = SamplingParams(max_tokens=g, temperature=0, ignore_eos=True)

    def once() -> tuple[float, float, list[list[int]]]:
        c0, t0 = time.process_time(), time.perf_counter()
        outs = llm.generate(prompts, params)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        assert all(len(o.outputs[0].token_ids) == g for o in outs)
        return batch * (p + g) / wall, cpu, [list(o.outputs[0].token_ids) for o in outs]

    once()  # warm-up
    return once


def offline(batches: list[int], p: int, g: int, repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for b in batches:
        got: dict[str, list[tuple[float, float]]] = {name: [] for name in MODES}
        for r in range(repeats):
            ids = {}
            for name, mode in MODES.items():
                # one engine at a time: a fresh one per run, the best of two runs of it
                run = make_offline(b, p, g, mode)
                first, second = run(), run()
                tok_s, cpu, ids[name] = max(first, second, key=lambda x: x[0])
                del run
                got[name].append((tok_s, cpu))
                print(
                    f"offline batch {b} repeat {r}: {name} {tok_s:.0f} tok/s, {cpu * 1e3:.0f} ms CPU",
                    flush=True,
                )
            assert ids["sync"] == ids["unplanned"] == ids["planned"], "greedy outputs differ"
        out[str(b)] = {
            name: {"best_tok_per_s": max(t for t, _ in v), "median_cpu_s": statistics.median(c for _, c in v)}
            for name, v in got.items()
        }
    return out


def server(p: int, g: int, requests: int, concurrency: int, repeats: int) -> dict[str, Any]:
    from hybridserve.benchmarks.serve_client import ServeConfig, serve_main
    from hybridserve.benchmarks.workloads import WorkloadSpec

    log_dir = ROOT / "benches" / "results" / "tmp"
    got: dict[str, list[dict[str, float]]] = {name: [] for name in MODES}
    for r in range(repeats):
        for name, (ov, planned) in MODES.items():
            flag = "--async-scheduling" if ov else "--no-async-scheduling"
            with planning(planned):
                srv = BenchServer(
                    ["--dtype", "float32", "--cpu-threads", "1", "--max-num-seqs", "64", flag],
                    log_dir / f"overlapped_steps_{name}.log",
                )
            try:
                srv.wait_ready()
                spec = WorkloadSpec(name="random", num_requests=requests, seed=r, prompt_len=p, max_tokens=g)
                cfg = ServeConfig(base_url=srv.base, workload=spec, concurrency=concurrency, progress=False)
                s = serve_main(cfg, None, None)["summary"]
            finally:
                srv.stop()
            row = {
                "output_tok_per_s": s["output_throughput"],
                "tpot_median_ms": s["tpot"]["median_ms"],
                "itl_median_ms": s["itl"]["median_ms"],
                "itl_p99_ms": s["itl"]["p99_ms"],
                "failed": s["failed"],
            }
            got[name].append(row)
            print(f"server repeat {r}: {name} {json.dumps(row)}", flush=True)
    return {
        name: {
            "best_output_tok_per_s": max(x["output_tok_per_s"] for x in v),
            "median_output_tok_per_s": statistics.median(x["output_tok_per_s"] for x in v),
            "best_tpot_median_ms": min(x["tpot_median_ms"] for x in v),
            "median_tpot_median_ms": statistics.median(x["tpot_median_ms"] for x in v),
            "median_itl_p99_ms": statistics.median(x["itl_p99_ms"] for x in v),
            "runs": v,
        }
        for name, v in got.items()
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-server", action="store_true")
    ap.add_argument("--server-requests", type=int, default=128)
    ap.add_argument("--server-concurrency", type=int, default=64)
    ap.add_argument("--result-file", type=Path, default=None)
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    p, g = a.prompt_len, a.output_len
    result: dict[str, Any] = {"load_average_before": os.getloadavg()}
    result["offline"] = offline([int(b) for b in a.batch.split(",")], p, g, a.repeats)
    if not a.no_server:
        result["server"] = server(p, g, a.server_requests, a.server_concurrency, a.repeats)
    result["load_average_after"] = os.getloadavg()
    print(f"\n{p} prompt + {g} output tokens per sequence, one compute thread, best of {a.repeats}")
    print("| where | batch | sync | overlapped, unplanned | overlapped, planned ahead | ratios to sync |")
    print("|---|---|---|---|---|---|")
    for b, v in result["offline"].items():
        s, u, o = (v[m]["best_tok_per_s"] for m in MODES)
        print(
            f"| offline `LLM.generate`, tok/s | {b} | {s:.0f} | {u:.0f} | {o:.0f} | {u / s:.2f}x / {o / s:.2f}x |"
        )
    if "server" in result:
        sv = result["server"]
        s, u, o = (sv[m]["best_output_tok_per_s"] for m in MODES)
        print(
            f"| server, streaming, output tok/s | {a.server_concurrency} | {s:.0f} | {u:.0f} | {o:.0f} "
            f"| {u / s:.2f}x / {o / s:.2f}x |"
        )
        s, u, o = (sv[m]["best_tpot_median_ms"] for m in MODES)
        print(
            f"| server, median TPOT (ms) | {a.server_concurrency} | {s:.2f} | {u:.2f} | {o:.2f} "
            f"| {s / u:.2f}x / {s / o:.2f}x lower |"
        )
    if a.result_file:
        a.result_file.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
