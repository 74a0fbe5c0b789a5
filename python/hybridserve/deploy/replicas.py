"""`hybridserve replicas`: N `hybridserve serve` replicas behind an off-the-shelf router.

    hybridserve replicas --num-replicas 2 --port 8000 -- demo --max-num-seqs 32
    hybridserve replicas --worker-urls http://gpu1:8000,http://gpu2:8000 --port 8000

Starts the replicas on consecutive ports (`--first-replica-port`, default `--port` + 1), each with
the `serve` arguments given after `--`, waits until every `/health` answers 200, then starts the
router (vllm-router, found on PATH or given by `--router-bin`) on `--port` in front of them. With
`--worker-urls` no replica is started: the router fronts servers that already run elsewhere.
SIGINT or SIGTERM stops the replicas first (each drains its in-flight requests, `serve
--shutdown-timeout`), then the router. The router is the only thing in the data path; this
process only starts, watches and stops. Exit status: 0 after a signal, 1 when the router or a
replica's start fails or the router dies.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import IO
from urllib.parse import urlsplit

from hybridserve.arg_types import int_in, not_empty, seconds
from hybridserve.config.kv_events import FLAG as KV_EVENTS_FLAG
from hybridserve.config.kv_events import KVEventsConfig
from hybridserve.errors import ConfigError

DEFAULT_ROUTER = "vllm-router"
# SGLang's gateway takes the same flags after its `launch` subcommand
_LAUNCH_SUBCOMMAND = {"sglang-router", "smg"}
POLICIES = ("cache_aware", "round_robin")
_SERVE_FLAGS_WE_SET = ("--port", "--host", "--uds")
# Beyond a replica's --shutdown-timeout, the seconds it may take to stop once its requests are
# done or aborted (the engine thread ends, the listener closes) before it is killed
STOP_MARGIN_S = 30.0
# The Prometheus port of vllm-router, sglang-router and smg when --prometheus-port is not given
ROUTER_METRICS_PORT = 29000


def add_replicas_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-replicas", type=int_in(1), default=2, help="replicas to start (default 2)")
    p.add_argument(
        "--worker-urls",
        default=None,
        metavar="URL,...",
        help="route to these running servers instead of starting replicas (other machines)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        type=not_empty("give an address, or 0.0.0.0 / :: for every interface"),
        help="address the router binds (default 127.0.0.1)",
    )
    p.add_argument("--port", type=int_in(1, 65535), default=8000, help="router port (default 8000)")
    p.add_argument(
        "--first-replica-port",
        type=int_in(1, 65535),
        default=None,
        help="port of the first replica, the others follow (default: --port + 1)",
    )
    p.add_argument(
        "--policy", choices=POLICIES, default="cache_aware", help="routing policy (default cache_aware)"
    )
    p.add_argument(
        "--router-bin",
        default=None,
        help=f"router executable (default: {DEFAULT_ROUTER} on PATH; sglang-router and smg also work)",
    )
    p.add_argument(
        "--health-check-interval",
        type=int_in(1),
        default=5,
        help="seconds between the router's health checks of each replica (default 5)",
    )
    p.add_argument(
        "--router-metrics-port",
        type=int_in(1, 65535),
        default=None,
        help="the router's Prometheus port (default: the router's own, 29000)",
    )
    p.add_argument(
        "--router-args",
        default="",
        help="more router flags, one shell-quoted string (e.g. '--cache-threshold 0.5')",
    )
    p.add_argument(
        "--startup-timeout",
        type=seconds(),
        default=600.0,
        help="seconds to wait for each replica and the router to answer /health (default 600)",
    )
    p.add_argument("--log-dir", default=None, help="write each replica's and the router's output here")
    p.add_argument(
        "serve_args",
        nargs=argparse.REMAINDER,
        metavar="-- MODEL [serve flags]",
        help="what each replica gets: `hybridserve serve` arguments (not --port/--host)",
    )


def router_command(args: argparse.Namespace, worker_urls: list[str]) -> list[str]:
    """The router's command line: its executable, the workers, the policy, the health checks."""
    if args.router_bin is not None:
        # checked before any replica starts, as the default router is
        binary = shutil.which(args.router_bin)
        if binary is None:
            raise ConfigError(f"--router-bin {args.router_bin}: no such executable")
    else:
        binary = shutil.which(DEFAULT_ROUTER)
        if binary is None:
            raise ConfigError(
                f"{DEFAULT_ROUTER} is not on PATH: `pip install vllm-router` or give --router-bin"
            )
    try:
        extra = shlex.split(args.router_args)
    except ValueError as e:
        raise ConfigError(f"--router-args: {e}") from None
    cmd = [binary, *(["launch"] if Path(binary).name in _LAUNCH_SUBCOMMAND else [])]
    cmd += ["--host", args.host, "--port", str(args.port), "--policy", args.policy]
    cmd += ["--worker-urls", *worker_urls]
    cmd += ["--health-check-interval-secs", str(args.health_check_interval)]
    if args.router_metrics_port is not None:
        cmd += ["--prometheus-port", str(args.router_metrics_port)]
    return cmd + extra


def _serve_args(args: argparse.Namespace) -> list[str]:
    serve = list(args.serve_args)
    if serve[:1] == ["--"]:
        serve = serve[1:]
    if args.worker_urls is not None:
        if serve:
            raise ConfigError("--worker-urls starts no replica: serve arguments make no sense with it")
        return []
    if not serve:
        raise ConfigError("give the replicas' model after `--`, e.g. `hybridserve replicas -- demo`")
    serve = _inline_config_files(serve)
    for flag in _SERVE_FLAGS_WE_SET:
        if any(a == flag or a.startswith(flag + "=") for a in serve):
            raise ConfigError(f"{flag} is set for each replica; use --first-replica-port / --host")
    # (the router and the health checks speak plain HTTP to the replicas)
    tls = [a for a in serve if a.startswith("--ssl-") or a.startswith("--ssl_")]
    if tls:
        raise ConfigError(
            f"{tls[0].partition('=')[0]}: the router reaches replicas over plain HTTP; put HTTPS in front of the router"
        )
    return serve


def _inline_config_files(serve: list[str]) -> list[str]:
    """The serve arguments with their `--config FILE`s written out, so that the flags a file gives
    are checked here as the command line's are (a file's `port` or `ssl-certfile` too)."""
    from hybridserve.cli import _flags, build_parser
    from hybridserve.config.cli import normalize_flag_names
    from hybridserve.config.config_file import expand_config_files

    parser = build_parser()
    # (spelled as `serve` reads them, so that a `--flag_name` given here wins over the file's)
    expanded, model = expand_config_files(parser, normalize_flag_names(["serve", *serve], _flags(parser)))
    if model is not None:
        try:
            ns, _ = parser.parse_known_args(expanded)
        except SystemExit:  # (argparse has printed what does not parse)
            raise ConfigError("the serve arguments after `--` do not parse") from None
        if ns.model is None and ns.model_option is None:
            expanded.append(f"--model={model}")
    return expanded[1:]


def replica_serve_args(serve: list[str], index: int) -> list[str]:
    """Replica `index`'s serve arguments. With KV cache events on, its sockets get addresses of
    their own, as vLLM's data-parallel ranks' do: a tcp:// port + `index`, an ipc:// or inproc://
    address + `_dp{index}` (replica 0's as given). Every replica on the same addresses would stop
    all but the first from starting (a tcp:// port is taken) or, on ipc://, leave only the last
    one's events reachable. A value that does not parse is passed as it is (the replica refuses it)."""
    out = list(serve)
    for i, a in enumerate(out):
        if a == KV_EVENTS_FLAG and i + 1 < len(out):
            out[i + 1] = _replica_kv_events(out[i + 1], index)
        elif a.startswith(KV_EVENTS_FLAG + "="):
            out[i] = f"{KV_EVENTS_FLAG}={_replica_kv_events(a.partition('=')[2], index)}"
    return out


def _replica_kv_events(value: str, index: int) -> str:
    try:
        cfg = json.loads(value)
    except ValueError:
        return value
    if index == 0 or not isinstance(cfg, dict) or cfg.get("enable_kv_cache_events") is not True:
        return value
    cfg.setdefault("endpoint", KVEventsConfig.endpoint)  # (the default binds tcp://*:5557)
    for field in ("endpoint", "replay_endpoint"):
        address = cfg.get(field)
        if not isinstance(address, str):
            continue
        scheme, _, rest = address.partition("://")
        host, sep, port = rest.rpartition(":")
        if scheme == "tcp" and sep and port.isdigit():
            cfg[field] = f"tcp://{host}:{int(port) + index}"
        elif scheme in ("ipc", "inproc") and rest:
            cfg[field] = f"{address}_dp{index}"
    return json.dumps(cfg)


def check_kv_event_ports(
    serve: list[str], replica_ports: list[int], router_ports: Sequence[tuple[str, int]] = ()
) -> None:
    """Refuses, before anything starts, replicas' KV-event tcp:// ports (each replica's + its
    index, `replica_serve_args`) that clash with one another's, a replica's HTTP port or the
    router's (`router_ports`: (name, port)), or that are in use already (a replica that cannot
    bind one exits; the router that cannot bind its own port fails only after the replicas
    loaded)."""
    seen = {port: name for name, port in router_ports}
    seen.update({port: f"replica{i}'s port" for i, port in enumerate(replica_ports)})
    for i in range(len(replica_ports)):
        args = replica_serve_args(serve, i)
        values = [v for a, v in zip(args, args[1:]) if a == KV_EVENTS_FLAG]
        values += [a.partition("=")[2] for a in args if a.startswith(KV_EVENTS_FLAG + "=")]
        try:
            cfg = KVEventsConfig.from_value(values[-1]) if values else None
        except ConfigError as e:
            if i == 0:
                return  # (as given: every replica refuses it and says why)
            # (the offset made it invalid, a port past 65535: refused now, not after replica 0 loaded)
            raise ConfigError(f"replica{i}'s {KV_EVENTS_FLAG}, its ports + {i}: {e}") from None
        for field in ("endpoint", "replay_endpoint") if cfg is not None and cfg.enabled else ():
            address = getattr(cfg, field)
            port = address.rpartition(":")[2] if address and address.startswith("tcp://") else ""
            if not port.isdigit():
                continue
            name = f"replica{i}'s {KV_EVENTS_FLAG} {field} {address}"
            if int(port) in seen:
                raise ConfigError(
                    f"{name} is also {seen[int(port)]}: each replica publishes on the given ports + "
                    "its index (as vLLM's data-parallel ranks); leave --num-replicas ports between "
                    "endpoint and replay_endpoint, and away from the replicas' ports"
                )
            seen[int(port)] = name
            if field == "endpoint" and not KVEventsConfig.binds(address):
                continue  # (a subscriber binds it: the replicas connect to it)
            host = address[len("tcp://") :].rpartition(":")[0].strip("[]")
            host = "0.0.0.0" if host in ("*", "") else host
            if _in_use(host, int(port)):
                raise ConfigError(f"{name}: the port is already in use on {host}")


def replica_stop_timeout(serve: list[str]) -> float:
    """How long a replica may take to drain and stop: its own `--shutdown-timeout` (a file's too:
    `serve` is written out) plus STOP_MARGIN_S."""
    import contextlib
    import io

    from hybridserve.cli import build_parser

    if not serve:
        return STOP_MARGIN_S
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # (the replicas print their own refusal)
            ns, _ = build_parser().parse_known_args(["serve", *serve])
    except SystemExit:  # (refused by the replicas themselves, which then never start)
        return STOP_MARGIN_S
    return float(getattr(ns, "shutdown_timeout", 0.0)) + STOP_MARGIN_S


_DEFAULT_METRICS = "the router's metrics port (its default; give --router-metrics-port)"


def router_ports(args: argparse.Namespace) -> list[tuple[str, int]]:
    """The ports the router listens on, (name, port): its --port, its metrics port given
    (--router-metrics-port) or else its default, 29000 (which, taken by another router on this
    machine, makes the router panic, and only after the replicas have loaded), unless
    --router-args gives its own flag for it (left to the router)."""
    named = [("--port", args.port)]
    if args.router_metrics_port is not None:
        named.append(("--router-metrics-port", args.router_metrics_port))
    elif "--prometheus-port" not in args.router_args:
        named.append((_DEFAULT_METRICS, ROUTER_METRICS_PORT))
    return named


def check_ports(args: argparse.Namespace, replica_ports: list[int]) -> None:
    """Refuses, before anything starts, ports that would clash: the router's, its metrics port and
    the replicas' must differ, and none may be in use already (a replica that cannot listen
    exits, and whatever answers on its port would pass its health check)."""
    router = router_ports(args)
    default = [named for named in router if named[0] == _DEFAULT_METRICS]
    given = [named for named in router if named not in default]
    # (the router's default metrics port, when it is one, is checked last: the others name the
    # flags given)
    named = [*given, *[(f"replica{i}'s port", port) for i, port in enumerate(replica_ports)], *default]
    seen: dict[int, str] = {}
    for name, port in named:
        if port in seen:
            raise ConfigError(
                f"{name} {port} is also {seen[port]}: give --port, --first-replica-port and "
                "--router-metrics-port ports that do not overlap"
            )
        seen[port] = name
    # (the router serves its metrics on 127.0.0.1, its --prometheus-host default, whatever --host)
    hosts = {"--port": args.host}
    for name, port in named:
        host = hosts.get(name, "127.0.0.1")
        if _in_use(host, port):
            raise ConfigError(f"{name} {port}: the port is already in use on {host}")


def _in_use(host: str, port: int) -> bool:
    """Whether binding (host, port) fails because the address is in use (other failures, a
    host name that does not resolve say, are left to the program that binds it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as servers bind: TIME_WAIT is free)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def _health(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return None


def _set_parent_death_signal() -> None:
    """Linux: the child gets SIGTERM when this process dies, even by SIGKILL (no orphans)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


_NOT_RUNNABLE = {errno.ENOEXEC, errno.EACCES, errno.ENOENT, errno.ENOTDIR, errno.EISDIR}


class _Children:
    """The processes this command started, in start order, with their names."""

    def __init__(self, log_dir: str | None) -> None:
        self.log_dir = Path(log_dir) if log_dir else None
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.stopping = False

    def start(self, name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        out: IO[bytes] | None = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{name}.log", "ab")  # the child writes to it
        print(f"hybridserve replicas: starting {name}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
        # its own session: a Ctrl-C in the terminal reaches the children once, through us
        try:
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                start_new_session=True,
                preexec_fn=_set_parent_death_signal if sys.platform == "linux" else None,
            )
        except OSError as e:
            # a program the user named that cannot be run (not a program, not allowed, gone) is
            # the user's error; the children started go (see replicas_main). Other failures
            # (no memory, no process left) are not, and keep their traceback.
            if e.errno not in _NOT_RUNNABLE:
                raise
            raise ConfigError(f"{name}: cannot run {cmd[0]}: {e.strerror or e}") from None
        finally:
            if out is not None:
                out.close()
        self.procs.append((name, proc))
        return proc

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def wait_healthy(self, waiting: list[tuple[str, subprocess.Popen[bytes], str]], timeout: float) -> bool:
        """Whether every (name, process, url) answers /health with 200 within `timeout` seconds,
        all watched at once: one that exits is reported at once, not after those before it have
        loaded."""
        deadline = time.monotonic() + timeout
        waiting = list(waiting)
        while not self.stopping:
            for name, proc, url in list(waiting):
                if proc.poll() is not None:
                    print(f"hybridserve replicas: {name} exited with {proc.returncode}", file=sys.stderr)
                    return False
                # (only while it runs: whatever answers once it has exited is not this child)
                if _health(url) == 200 and proc.poll() is None:
                    waiting.remove((name, proc, url))
            if not waiting:
                return True
            if time.monotonic() > deadline:
                names = ", ".join(name for name, _, _ in waiting)
                print(f"hybridserve replicas: {names} not healthy after {timeout:.0f}s", file=sys.stderr)
                return False
            time.sleep(0.2)
        return False

    def stop(self, timeout: float = STOP_MARGIN_S) -> bool:
        """SIGTERM the replicas and wait up to `timeout` seconds (they drain), then the router;
        True when every child that was still running exits 0 (one that died before was reported
        when it did)."""
        ok = True
        running = [(n, p) for n, p in self.procs if p.poll() is None]
        replicas = [(n, p) for n, p in running if n != "router"]
        router = [(n, p) for n, p in running if n == "router"]
        for group in (replicas, router):
            for _, proc in group:
                proc.send_signal(signal.SIGTERM)
            for name, proc in group:
                try:
                    rc = proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    print(f"hybridserve replicas: {name} did not stop; killing it", file=sys.stderr)
                    proc.kill()
                    rc = proc.wait()
                ok = ok and rc == 0
        return ok


def parse_worker_urls(value: str) -> list[str]:
    """--worker-urls: servers' base URLs (http or https, a host, a port or none; no path: the
    router adds /v1/...), each once; a ConfigError names the first that is not one (the router
    would end with a traceback, or route to /v1/v1/...)."""
    urls = [u.strip().rstrip("/") for u in value.split(",") if u.strip()]
    if not urls:
        raise ConfigError("--worker-urls: no URL")
    seen: dict[tuple[str, str, int | None], str] = {}
    for u in urls:
        parts = urlsplit(u)
        try:
            port = parts.port
        except ValueError:
            port = 0
        shape = "expected http://HOST:PORT or https://HOST:PORT"
        if parts.scheme not in ("http", "https") or not parts.hostname or " " in parts.netloc:
            raise ConfigError(f"--worker-urls: {u!r}: {shape}")
        if port == 0 or parts.netloc.endswith(":"):
            raise ConfigError(f"--worker-urls: {u!r}: the port is not a number in 1-65535")
        if parts.username is not None or parts.query or parts.fragment or parts.path:
            raise ConfigError(f"--worker-urls: {u!r}: {shape}, a server's base URL (the router adds /v1/...)")
        key = (parts.scheme, parts.hostname, port)  # (hostname: lower-cased)
        if key in seen:
            raise ConfigError(f"--worker-urls: {seen[key]!r} and {u!r} are one server")
        seen[key] = u
    return urls


def replicas_main(args: argparse.Namespace) -> int:
    serve = _serve_args(args)
    if args.worker_urls is not None:
        worker_urls = parse_worker_urls(args.worker_urls)
    else:
        first = args.first_replica_port or args.port + 1
        if first + args.num_replicas - 1 > 65535:
            raise ConfigError("--first-replica-port: the replicas' ports run past 65535")
        worker_urls = [f"http://127.0.0.1:{first + i}" for i in range(args.num_replicas)]
    router_cmd = router_command(args, worker_urls)
    check_ports(args, [int(u.rsplit(":", 1)[1]) for u in worker_urls] if serve else [])
    if serve:
        check_kv_event_ports(serve, [int(u.rsplit(":", 1)[1]) for u in worker_urls], router_ports(args))
    stop_timeout = replica_stop_timeout(serve)

    children = _Children(args.log_dir)
    old = {s: signal.signal(s, children.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for i, url in enumerate(worker_urls if serve else []):
            port = url.rsplit(":", 1)[1]
            cmd = [sys.executable, "-m", "hybridserve", "serve", *replica_serve_args(serve, i)]
            children.start(f"replica{i}", [*cmd, "--host", "127.0.0.1", "--port", port])
        replicas = [(name, proc, worker_urls[i]) for i, (name, proc) in enumerate(children.procs)]
        if not children.wait_healthy(replicas, args.startup_timeout):
            children.stop(stop_timeout)
            return 0 if children.stopping else 1
        router = children.start("router", router_cmd)
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        router_url = f"http://{f'[{host}]' if ':' in host else host}:{args.port}"
        if not children.wait_healthy([("router", router, router_url)], args.startup_timeout):
            children.stop(stop_timeout)
            return 0 if children.stopping else 1
        print(
            f"hybridserve replicas: ready: {router_url} routes ({args.policy}) to {', '.join(worker_urls)}",
            file=sys.stderr,
            flush=True,
        )
        dead: set[str] = set()
        while not children.stopping:
            if router.poll() is not None:
                print(f"hybridserve replicas: the router exited with {router.returncode}", file=sys.stderr)
                children.stop(stop_timeout)
                return 1
            for name, proc in children.procs:
                if name not in dead and proc.poll() is not None:
                    dead.add(name)  # the router's health checks take it out of rotation
                    print(f"hybridserve replicas: {name} exited with {proc.returncode}", file=sys.stderr)
            time.sleep(0.2)
        return 0 if children.stop(stop_timeout) else 1
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        for _, proc in children.procs:  # an exception above: leave nothing behind
            if proc.poll() is None:
                proc.kill()
