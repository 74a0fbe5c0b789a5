"""`hybridserve bench serve | offline`.

    hybridserve bench serve --base-url http://127.0.0.1:8000 --workload shared-prefix \\
        --num-requests 64 --request-rate 4 --concurrency 16 --result-file r.json --plot charts/
    hybridserve bench serve --workload trace --trace T2 --trace-scale 0.25 --result-file t2.json
    hybridserve bench offline --model demo --num-prompts 64 --prompt-len 256 --output-len 128
    hybridserve bench cache-trace --traces T1,T2,T3:3,T4 --budgets 10,3,1.5 --report r.md --plot charts/

`serve` works against any OpenAI-compatible server (token-id prompts to /v1/completions, streamed);
`--workload trace` replays a request trace (`benchmarks/traces.py`: a JSONL file, or a generated
T1-T4). `offline` runs the engine through the LLM API without HTTP. `cache-trace` replays traces
through the engine's scheduler and cache with the model faked (`benchmarks/cache_replay.py`). The CLI builds this parser, so
no torch (nor matplotlib) at module level: the engine and the plots load inside the handlers.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

from hybridserve.arg_types import int_in, seconds
from hybridserve.benchmarks.traces import MAX_SCALE, TRACE_KINDS, Trace, TraceError, generate, read_trace
from hybridserve.benchmarks.workloads import WORKLOADS, WorkloadSpec
from hybridserve.errors import ConfigError

TRACE_WORKLOAD = "trace"


def _rate(text: str) -> float:
    v = float(text)
    if math.isnan(v) or v <= 0:
        raise argparse.ArgumentTypeError("must be > 0 or inf")
    return v


def _factor(allow_zero: bool) -> Callable[[str], float]:
    """A finite number > 0 (>= 0 with allow_zero)."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (0 <= v if allow_zero else 0 < v) or not v < math.inf:
            raise argparse.ArgumentTypeError(
                f"must be a finite number {'>=' if allow_zero else '>'} 0, got {text}"
            )
        return v

    return parse


def add_bench_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench_mode", metavar="MODE", required=True)
    s = sub.add_parser("serve", help="load generator against an OpenAI-compatible server", allow_abbrev=False)
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (no /v1)")
    s.add_argument(
        "--workload",
        choices=(*WORKLOADS, TRACE_WORKLOAD),
        default="random",
        help="trace: replay --trace (its own requests, times and lengths: --num-requests, "
        "--request-rate, --prompt-len and --max-tokens are refused with it)",
    )
    # (these four default to None, so that a trace, which has its own, refuses them)
    s.add_argument(
        "--num-requests",
        type=int_in(1),
        default=None,
        help="requests in all (turns count one each; default 64)",
    )
    s.add_argument(
        "--request-rate",
        type=_rate,
        default=None,
        help="Poisson arrivals per second (inf: all at once, the default); with multi-turn, of conversations, "
        "each sending its turns one after another",
    )
    s.add_argument(
        "--concurrency", type=int_in(1), default=None, help="most requests in flight (default: no limit)"
    )
    s.add_argument(
        "--max-tokens", type=int_in(1), default=None, help="tokens generated per request (default 64)"
    )
    s.add_argument(
        "--prompt-len",
        type=int_in(1),
        default=None,
        help="prompt tokens (per turn for multi-turn; default 256)",
    )
    s.add_argument(
        "--prefix-len",
        type=int_in(1),
        default=None,
        help="shared-prefix: shared tokens (default 3/4 of --prompt-len)",
    )
    # (None: not given, so that a flag of another workload is refused, not left unused)
    s.add_argument(
        "--num-prefixes",
        type=int_in(1),
        default=None,
        help="shared-prefix: distinct shared prefixes (default 1)",
    )
    s.add_argument(
        "--num-turns", type=int_in(1), default=None, help="multi-turn: turns per conversation (default 3)"
    )
    s.add_argument(
        "--trace",
        default=None,
        metavar="FILE|T1|T2|T3|T4",
        help="trace: a JSONL trace file, or the kind of trace to generate (a file named like a kind: ./T1)",
    )
    s.add_argument(
        "--trace-seed", type=int_in(0), default=None, help="trace: seed of a generated trace (default 0)"
    )
    s.add_argument(
        "--trace-scale",
        type=_factor(allow_zero=False),
        default=None,
        help="trace: a generated trace's requests (T1, T4) or sessions (T2, T3) times this (default 1)",
    )
    s.add_argument(
        "--trace-time-scale",
        type=_factor(allow_zero=True),
        default=None,
        help="trace: multiplies arrival and think times (0.5: twice as fast; 0: no waiting; default 1)",
    )
    s.add_argument(
        "--token-id-max", type=int_in(4), default=256, help="prompt token ids are drawn from [3, this)"
    )
    s.add_argument("--seed", type=int_in(0), default=0)
    s.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    s.add_argument("--temperature", type=_factor(True), default=0.0)
    s.add_argument(
        "--no-ignore-eos", dest="ignore_eos", action="store_false", help="let EOS end requests early"
    )
    s.add_argument("--api-key", default=None)
    s.add_argument(
        "--request-timeout",
        type=seconds(),
        default=600.0,
        help="seconds without data before a request fails",
    )
    s.add_argument(
        "--ready-timeout", type=seconds(), default=120.0, help="seconds to wait for GET /health = 200"
    )
    s.add_argument("--result-file", default=None, help="write the JSON result here")
    s.add_argument("--plot", default=None, metavar="DIR", help="write PNG charts into DIR (needs matplotlib)")
    s.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")

    c = sub.add_parser(
        "cache-trace",
        allow_abbrev=False,
        help="prefix-cache placement and eviction policies replayed on request traces (no model)",
    )
    c.add_argument(
        "--traces",
        type=_trace_specs,
        default=None,
        help="generated traces, comma-separated KIND[:SCALE] (T1..T4; default T1,T2,T3:3,T4 without "
        "--trace-file)",
    )
    c.add_argument(
        "--trace-file", action="append", default=[], metavar="FILE", help="a JSONL trace (repeatable)"
    )
    c.add_argument("--seed", type=int_in(0), default=0, help="seed of the generated traces")
    c.add_argument(
        "--budgets",
        type=_numbers(_factor(False)),
        default=(10.0, 3.0, 1.5),
        help="state pools, in multiples of the running windows (default 10,3,1.5)",
    )
    c.add_argument(
        "--policies",
        type=_names,
        default=None,
        help="comma-separated, of oracle, grid-lru, vllm-like, sglang-like, branch-lru, hybridserve, "
        "per-block-lru (default: all but per-block-lru)",
    )
    c.add_argument(
        "--modes",
        type=_names,
        default=("auto",),
        help="mamba cache modes: auto (the engine's default), all, align (comma-separated)",
    )
    c.add_argument("--speculation", type=_names, default=("off",), help="off and/or ngram (comma-separated)")
    c.add_argument(
        "--flop-weights",
        type=_numbers(_factor(True)),
        default=(),
        help="also run hybridserve with these weights of FLOPs against recency (a sweep)",
    )
    from hybridserve import _core

    # (bounded as the engine bounds it: a number beyond a C long was an OverflowError traceback)
    c.add_argument(
        "--max-num-seqs",
        type=int_in(1, _core.MAX_NUM_SEQS),
        default=32,
        help="running sequences (default 32)",
    )
    c.add_argument("--workers", type=int_in(1), default=1, help="processes (default 1)")
    c.add_argument("--result-file", default=None, help="write every cell as JSON here")
    c.add_argument("--report", default=None, metavar="FILE", help="write the markdown tables here")
    c.add_argument("--plot", default=None, metavar="DIR", help="write PNG charts into DIR (needs matplotlib)")

    o = sub.add_parser("offline", help="engine throughput through the LLM API (no HTTP)", allow_abbrev=False)
    from hybridserve.config import add_engine_args

    o.add_argument("--model", default="demo", help="model folder, or 'demo' (default)")
    add_engine_args(o, model_positional=False)
    o.add_argument("--num-prompts", type=int_in(1), default=64)
    o.add_argument("--prompt-len", type=int_in(1), default=256)
    o.add_argument("--output-len", type=int_in(1), default=128)
    o.add_argument("--result-file", default=None, help="write the JSON result here")
    o.add_argument(
        "--warmup",
        choices=["short", "full", "none"],
        default="short",
        help="before the timed run: two short requests (default), the whole workload once (the timed run "
        "then meets no step shape for the first time; on a GPU a first pass can cost more than the run), "
        "or nothing; the prefix cache is emptied after it",
    )


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated list, each item once (a repeat would run again and show once)."""
    names = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    if not names:
        raise argparse.ArgumentTypeError("needs at least one name")
    return names


def _numbers(parse: Callable[[str], float]) -> Callable[[str], tuple[float, ...]]:
    def parse_all(text: str) -> tuple[float, ...]:
        return tuple(dict.fromkeys(parse(x) for x in _names(text)))

    return parse_all


def _trace_specs(text: str) -> tuple[tuple[str, float], ...]:
    """'T1,T3:3' -> (("T1", 1.0), ("T3", 3.0))."""
    out = []
    for item in _names(text):
        kind, _, scale = item.partition(":")
        if kind.upper() not in TRACE_KINDS:
            raise argparse.ArgumentTypeError(f"unknown trace {kind!r}: one of {', '.join(TRACE_KINDS)}")
        factor = _factor(False)(scale) if scale else 1.0
        if factor > MAX_SCALE:
            raise argparse.ArgumentTypeError(f"trace scale {scale!r}: at most {MAX_SCALE:g}")
        out.append((kind.upper(), factor))
    return tuple(dict.fromkeys(out))


def _check_output_path(flag: str, path: str | None, is_dir: bool = False) -> None:
    """Refuses a result path that cannot be written before the benchmark runs, not after it."""
    if path is None:
        return
    p = Path(path)
    parent = p if is_dir and p.exists() else p.parent
    if p.is_dir() != is_dir and p.exists():
        raise ConfigError(f"{flag}: {path!r} is {'not ' if is_dir else ''}a folder")
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ConfigError(f"{flag}: cannot write into {str(parent)!r}")


def _load_trace(args: argparse.Namespace) -> tuple[Trace | None, str | None]:
    """The trace of `--workload trace` and where it came from, (None, None) for other workloads.
    Every problem with the flags or the file is a ConfigError (one line, exit status 2); a
    malformed file's message names the line."""
    if args.workload != TRACE_WORKLOAD:
        used = [f for f, v in (("--trace", args.trace), ("--trace-seed", args.trace_seed),
                               ("--trace-scale", args.trace_scale),
                               ("--trace-time-scale", args.trace_time_scale)) if v is not None]  # fmt: skip
        if used:
            raise ConfigError(f"{used[0]} needs --workload trace")
        return None, None
    if args.trace is None:
        raise ConfigError("--workload trace needs --trace FILE (a JSONL trace) or --trace T1|T2|T3|T4")
    kind = args.trace.upper()
    if kind in TRACE_KINDS:
        seed = 0 if args.trace_seed is None else args.trace_seed
        scale = 1.0 if args.trace_scale is None else args.trace_scale
        try:
            trace = generate(kind, seed=seed, scale=scale, token_id_max=args.token_id_max)
        except ValueError as e:
            raise ConfigError(f"--trace {kind}: {e}") from None
        return trace, f"{kind} seed={seed} scale={scale:g}"
    if args.trace_seed is not None or args.trace_scale is not None:
        raise ConfigError("--trace-seed and --trace-scale apply to a generated trace (T1-T4), not to a file")
    try:
        return read_trace(args.trace), args.trace
    except TraceError as e:
        raise ConfigError(f"--trace: {e}") from None
    except OSError as e:
        raise ConfigError(f"--trace: cannot read {args.trace!r}: {e.strerror or e}") from None


# The sizes of a generated workload (not a trace's: it has its own), and their defaults.
_WORKLOAD_SIZES = (
    ("--num-requests", "num_requests", 64),
    ("--request-rate", "request_rate", math.inf),
    ("--prompt-len", "prompt_len", 256),
    ("--max-tokens", "max_tokens", 64),
)


def _workload_defaults(args: argparse.Namespace) -> None:
    """Fills in the sizes of a generated workload that were not given; with a trace, one given
    is a ConfigError (the trace's requests, times and lengths are its own, and a run that
    ignored the flag would be a different run than the one asked for)."""
    for flag, name, default in _WORKLOAD_SIZES:
        if getattr(args, name) is None:
            setattr(args, name, default)
        elif args.workload == TRACE_WORKLOAD:
            raise ConfigError(f"{flag} does not apply to --workload trace: the trace sets its own requests")


def _url_error(url: str) -> str | None:
    """Why an http(s) URL names no server, or None."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError: not a number or out of range
    except ValueError as e:
        return str(e)
    if not parts.hostname:
        return "no host"
    if port == 0:
        return "port 0 is no server's"
    return None


def bench_main(args: argparse.Namespace) -> int:
    _check_output_path("--result-file", args.result_file)
    if args.bench_mode == "serve":
        _check_output_path("--plot", args.plot, is_dir=True)
        from hybridserve.benchmarks.serve_client import ServeConfig, serve_main

        base_url = args.base_url.rstrip("/")
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"--base-url must start with http:// or https://, got {args.base_url!r}")
        if (why := _url_error(base_url)) is not None:  # said now, not after --ready-timeout
            raise ConfigError(f"--base-url {args.base_url!r}: {why}")
        base_url = base_url.removesuffix("/v1")  # the server root: /v1 is added per route
        for flag, value, workload in (
            ("--prefix-len", args.prefix_len, "shared-prefix"),
            ("--num-prefixes", args.num_prefixes, "shared-prefix"),
            ("--num-turns", args.num_turns, "multi-turn"),
        ):
            if value is not None and args.workload != workload:
                raise ConfigError(f"{flag} applies to --workload {workload}, not {args.workload}")
        _workload_defaults(args)
        trace, trace_source = _load_trace(args)
        if args.prefix_len is not None and args.prefix_len >= args.prompt_len:
            raise ConfigError(
                f"--prefix-len {args.prefix_len} leaves no unique tokens in --prompt-len {args.prompt_len}: "
                "give fewer"
            )
        spec = WorkloadSpec(
            name=args.workload,
            num_requests=args.num_requests,
            prompt_len=args.prompt_len,
            max_tokens=args.max_tokens,
            seed=args.seed,
            prefix_len=args.prefix_len,
            **{
                k: v
                for k, v in (("num_prefixes", args.num_prefixes), ("num_turns", args.num_turns))
                if v is not None
            },
            token_id_max=args.token_id_max,
        )
        cfg = ServeConfig(
            base_url=base_url,
            workload=spec,
            request_rate=args.request_rate,
            concurrency=args.concurrency,
            model=args.model,
            ignore_eos=args.ignore_eos,
            temperature=args.temperature,
            request_timeout=args.request_timeout,
            api_key=args.api_key,
            progress=args.progress,
            ready_timeout=args.ready_timeout,
            trace=trace,
            trace_source=trace_source,
            trace_time_scale=1.0 if args.trace_time_scale is None else args.trace_time_scale,
        )
        try:
            result = serve_main(cfg, args.result_file, args.plot)
        except RuntimeError as e:  # the server cannot be reached or used: one line, not a traceback
            print(f"hybridserve bench serve: error: {e}", file=sys.stderr)
            return 1
        return 0 if result["summary"]["completed"] > 0 else 1
    if args.bench_mode == "cache-trace":
        return _cache_trace_main(args)
    from hybridserve.benchmarks.offline import offline_main
    from hybridserve.config import EngineArgs

    ea = EngineArgs.from_cli(args)
    offline_main(
        ea, args.num_prompts, args.prompt_len, args.output_len, args.seed, args.result_file, args.warmup
    )
    return 0


def _cache_trace_main(args: argparse.Namespace) -> int:
    _check_output_path("--report", args.report)
    _check_output_path("--plot", args.plot, is_dir=True)
    from hybridserve.benchmarks import cache_replay as cr

    policies = args.policies or cr.DEFAULT_POLICIES
    unknown = [p for p in policies if p not in cr.POLICIES]
    if unknown:
        raise ConfigError(f"--policies: unknown {unknown[0]!r}; one of {', '.join(cr.POLICIES)}")
    if all(cr.POLICIES[p].oracle for p in policies):
        raise ConfigError(
            "--policies: the oracle is what the others are measured against; add another policy"
        )
    bad_mode = [m for m in args.modes if m not in ("auto", "all", "align")]
    if bad_mode:
        raise ConfigError(f"--modes: {bad_mode[0]!r} is not one of auto, all, align")
    bad_spec = [x for x in args.speculation if x not in ("off", "ngram")]
    if bad_spec:
        raise ConfigError(f"--speculation: {bad_spec[0]!r} is not one of off, ngram")
    traces: list[Trace] = []
    for path in dict.fromkeys(args.trace_file):
        try:
            traces.append(read_trace(path))
        except TraceError as e:
            raise ConfigError(f"--trace-file: {e}") from None
        except OSError as e:
            raise ConfigError(f"--trace-file: cannot read {path!r}: {e.strerror or e}") from None
    specs = args.traces if args.traces is not None else (() if traces else cr.DEFAULT_TRACES)
    traces += [generate(kind, seed=args.seed, scale=scale) for kind, scale in specs]
    sources = [f"--trace-file {p}" for p in dict.fromkeys(args.trace_file)]
    sources += [f"--traces {kind}:{scale:g}" for kind, scale in specs]
    # The cells and the report's rows are keyed by the trace's name: two traces of one name (two
    # files x.jsonl in two folders) showed as one row, the other trace's results dropped.
    first: dict[str, str] = {}
    for trace, source in zip(traces, sources):
        if trace.name in first:
            raise ConfigError(
                f"{source}: its trace is named {trace.name!r}, as {first[trace.name]}'s is: the results "
                'are kept by name (name a file\'s trace on its first line: {"trace": NAME})'
            )
        first[trace.name] = source
    exp = cr.Experiment(
        traces=tuple(traces),
        budgets=tuple(args.budgets),
        policies=tuple(policies),
        modes=tuple(None if m == "auto" else m for m in args.modes),
        speculation=tuple(x == "ngram" for x in args.speculation),
        flop_weights=tuple(args.flop_weights),
        max_num_seqs=args.max_num_seqs,
    )
    results = cr.run_experiment(exp, workers=args.workers)
    text = cr.report(results)
    print(text)
    if args.report:
        Path(args.report).write_text(text)
    if args.result_file:
        import json

        payload = {
            "traces": [t.name for t in traces],
            "cost_model": cr.nemotron_h_8b().name,
            "cells": [r.to_dict() for r in results],
        }
        Path(args.result_file).write_text(json.dumps(payload, indent=1))
    if args.plot:
        for path in cr.plot(results, args.plot):
            print(f"wrote {path}")
    return 0
