"""Replicas behind an off-the-shelf router (vllm-router, pip `vllm-router`): real `hybridserve serve`
processes and the real router binary, HTTP only.

- cache-aware routing of a shared-prefix workload gets about the prefix-cache hits one replica
  serving everything gets, and clearly more than round-robin (hits read from each replica's
  /metrics);
- a replica killed (SIGKILL) mid-run: its in-flight streams break (none hangs), the router's health
  checks take it out, and every request sent afterwards completes on the other replica;
- `hybridserve replicas` starts replicas and the router, serves through it, and SIGTERM stops
  every process it started; with --worker-urls it fronts servers it did not start.

`make test` installs the router into `.venv-router` (see the Makefile); `HYBRIDSERVE_ROUTER` names
another router binary. Without any, these tests skip.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from hybridserve.model.demo import ensure_demo_model
from server_fixtures import ROOT, ServerProcess, free_port, get_metrics

_OWN_ENV = ROOT / ".venv-router" / "bin" / "vllm-router"
ROUTER = (
    os.environ.get("HYBRIDSERVE_ROUTER")
    or (str(_OWN_ENV) if _OWN_ENV.exists() else None)
    or shutil.which("vllm-router")
)

pytestmark = pytest.mark.skipif(
    not ROUTER, reason="vllm-router not installed (make test installs it into .venv-router)"
)

HIT = "hybridserve_prefix_cache_hit_tokens_total"
QUERIED = "hybridserve_prefix_cache_queried_tokens_total"
GROUPS, PER_GROUP = 4, 4
DEMO_CORPUS = ROOT / "python" / "hybridserve" / "model" / "demo_corpus.txt"  # words the tokenizer knows
CLIENT_TIMEOUT_S = 30.0
STREAM_TOKENS = 3000  # long enough to be cut: the kill comes at the first chunks


def _post(url: str, body: dict[str, Any], timeout: float = CLIENT_TIMEOUT_S) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.status == 200
        out: dict[str, Any] = json.loads(r.read())
        return out


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return int(r.status) == 200
    except (urllib.error.URLError, OSError):
        return False


class Router:
    """The router binary in front of `workers`, ready when its /health answers 200."""

    def __init__(self, workers: list[ServerProcess], policy: str, *extra: str) -> None:
        assert ROUTER is not None
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="router-", suffix=".log", delete=False)
        cmd = [ROUTER, "--port", str(self.port), "--policy", policy]
        cmd += ["--worker-urls", *[w.base for w in workers], "--prometheus-port", str(free_port())]
        self.proc = subprocess.Popen([*cmd, *extra], stdout=self.log, stderr=subprocess.STDOUT)
        self.log.close()
        deadline = time.monotonic() + 60
        while not _healthy(self.base):
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < deadline, self.output()
            time.sleep(0.1)

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        Path(self.log.name).unlink(missing_ok=True)


def _start_servers(n: int) -> list[ServerProcess]:
    ensure_demo_model()
    servers = [ServerProcess() for _ in range(n)]  # they load side by side
    for s in servers:
        s.wait_ready()
    return servers


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[ServerProcess]]:
    """Three demo replicas: A and B for the routing tests, C to be killed."""
    servers = _start_servers(3)
    yield servers
    for s in servers:
        s.stop()
        s.remove_log()


def _shared_prefix_workload(seed: int) -> list[str]:
    """GROUPS groups of PER_GROUP prompts; a group's prompts share a ~300-token prefix (random
    words, a different set for every seed, so that no phase hits another phase's cache) and end
    in a short suffix of their own. Sent round by round, one prompt of each group per round, the
    groups in a rotated order each round: with 2 replicas, round-robin then sends every group's
    prompts to both (a plain interleave of an even number of groups would send each group to one
    replica by accident, as cache-aware routing does on purpose)."""
    rng = random.Random(seed)
    words = sorted(set(DEMO_CORPUS.read_text().split()))
    prefixes = [" ".join(rng.choices(words, k=150)) for _ in range(GROUPS)]
    prompts = []
    for r in range(PER_GROUP):
        for k in range(GROUPS):
            g = (k + r) % GROUPS
            prompts.append(f"{prefixes[g]} question {r}: {' '.join(rng.choices(words, k=4))}?")
    return prompts


def _hits(servers: list[ServerProcess]) -> tuple[float, float]:
    """(hit tokens, queried tokens) summed over the servers' /metrics."""
    ms = [get_metrics(s) for s in servers]
    return sum(m[HIT] for m in ms), sum(m[QUERIED] for m in ms)


def _run_workload(base: str, prompts: list[str], servers: list[ServerProcess]) -> tuple[float, float]:
    """Send the prompts one after another to `base`; the hit and queried tokens they caused."""
    hit0, q0 = _hits(servers)
    for p in prompts:
        out = _post(
            base + "/v1/completions", {"model": "demo", "prompt": p, "max_tokens": 2, "temperature": 0}
        )
        assert out["usage"]["completion_tokens"] == 2
    hit1, q1 = _hits(servers)
    return hit1 - hit0, q1 - q0


def test_cache_aware_routing_hits_like_one_replica_and_beats_round_robin(replicas):
    a, b, _ = replicas
    n_prompt = _post(a.base + "/tokenize", {"prompt": _shared_prefix_workload(0)[0]})["count"]
    assert 250 <= n_prompt <= 450, n_prompt

    single_hit, single_q = _run_workload(a.base, _shared_prefix_workload(1), [a])
    ca = Router([a, b], "cache_aware")
    try:
        ca_hit, ca_q = _run_workload(ca.base, _shared_prefix_workload(2), [a, b])
    finally:
        ca.stop()
    rr = Router([a, b], "round_robin")
    try:
        rr_hit, rr_q = _run_workload(rr.base, _shared_prefix_workload(3), [a, b])
    finally:
        rr.stop()

    rates = {"single": single_hit / single_q, "cache_aware": ca_hit / ca_q, "round_robin": rr_hit / rr_q}
    print(f"hit rates {rates}; hit tokens single {single_hit}, cache_aware {ca_hit}, round_robin {rr_hit}")
    assert rates["cache_aware"] >= 0.95 * rates["single"], rates
    assert rates["cache_aware"] >= 1.3 * rates["round_robin"], rates


def _stream(base: str, prompt: str, max_tokens: int, started: threading.Event) -> tuple[str, int, float]:
    """One streamed completion: ("done" | "broken", tokens received, seconds taken): the tokens of
    its usage chunk (a client that falls behind gets several tokens in a chunk), else the chunks
    seen. A broken connection, a truncated stream, an error event or a non-200 answer are all
    "broken"; a stream that stalls longer than the client timeout fails the test (nothing may hang)."""
    t0 = time.monotonic()
    body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    req = urllib.request.Request(
        base + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    chunks = 0
    try:
        with urllib.request.urlopen(req, timeout=CLIENT_TIMEOUT_S) as r:
            for line in r:
                if line.startswith(b"data: [DONE]"):
                    return "done", chunks, time.monotonic() - t0
                if line.startswith(b"data: "):
                    if b'"error"' in line:
                        break
                    usage = json.loads(line[6:]).get("usage")
                    chunks = usage["completion_tokens"] if usage else chunks + 1
                    started.set()
    except TimeoutError:
        raise AssertionError(f"a stream stalled for {CLIENT_TIMEOUT_S}s") from None
    except (urllib.error.HTTPError, ConnectionError, OSError, ValueError) as e:
        if isinstance(getattr(e, "reason", None), TimeoutError):
            raise AssertionError(f"a stream stalled for {CLIENT_TIMEOUT_S}s") from None
    return "broken", chunks, time.monotonic() - t0


def _finished(server: ServerProcess) -> float:
    m = get_metrics(server)
    return sum(v for k, v in m.items() if k.startswith("hybridserve_requests_finished_total"))


def test_a_killed_replica_breaks_its_streams_and_the_rest_complete_on_the_other(replicas):
    a, _, c = replicas
    router = Router(
        [a, c], "round_robin", "--health-check-interval-secs", "1", "--health-failure-threshold", "2"
    )
    try:
        with ThreadPoolExecutor(4) as pool:
            started = [threading.Event() for _ in range(4)]
            streams = [
                pool.submit(_stream, router.base, f"story {i}:", STREAM_TOKENS, started[i]) for i in range(4)
            ]
            # every stream under way (its answer begun: the router can no longer retry it elsewhere)
            assert all(e.wait(timeout=30) for e in started), "the streams did not start"
            assert get_metrics(c)["hybridserve_server_inflight_requests"] == 2  # round-robin: two each
            a_finished = _finished(a)
            c.proc.kill()  # SIGKILL: no drain, connections cut
            c.proc.wait()
            # sent right away, before the health checks notice: the router retries them on A
            early = [
                _post(router.base + "/v1/completions", {"prompt": f"now {i}", "max_tokens": 2})
                for i in range(4)
            ]
            outcomes = [s.result() for s in streams]
        print(f"streams {outcomes}")
        assert sorted(o[0] for o in outcomes) == ["broken", "broken", "done", "done"], outcomes
        assert all(o[1] == STREAM_TOKENS for o in outcomes if o[0] == "done")

        deadline = time.monotonic() + 15  # interval 1 s, 2 failures
        while True:
            health = {w["url"]: w["is_healthy"] for w in _get_json(router.base + "/workers")["workers"]}
            if health == {a.base: True, c.base: False}:
                break
            assert time.monotonic() < deadline, health
            time.sleep(0.2)
        late = [
            _post(router.base + "/v1/completions", {"prompt": f"later {i}", "max_tokens": 2})
            for i in range(8)
        ]
        assert all(r["usage"]["completion_tokens"] == 2 for r in early + late)
        assert _finished(a) - a_finished == 2 + len(early) + len(late)  # A's two streams, then all
    finally:
        router.stop()


def _free_consecutive_ports(n: int) -> int:
    for _ in range(50):
        first = free_port()
        try:
            socks = []
            for p in range(first, first + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no free consecutive ports")


def _children(pid: int) -> list[int]:
    """The live (not zombie) processes whose parent is `pid`."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _launch(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    port = free_port()
    log = tmp_path / "replicas.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "hybridserve", "replicas", "--port", str(port), "--router-bin", str(ROUTER)]
    cmd += ["--router-metrics-port", str(free_port()), "--log-dir", str(tmp_path / "logs"), *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while "hybridserve replicas: ready: " not in log.read_text():  # it has seen the router healthy
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    return proc, base, log


def test_the_replicas_command_serves_through_the_router_and_sigterm_stops_everything(tmp_path):
    ensure_demo_model()
    first = _free_consecutive_ports(2)
    proc, base, log = _launch(
        tmp_path, "--first-replica-port", str(first), "--", "demo", "--max-num-seqs", "8"
    )
    try:
        assert [w["url"] for w in _get_json(base + "/workers")["workers"]] != []
        out = _post(base + "/v1/completions", {"model": "demo", "prompt": "The quick brown", "max_tokens": 4})
        assert out["usage"]["completion_tokens"] == 4
        children = _children(proc.pid)
        assert len(children) == 3  # two replicas and the router
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert [pid for pid in children if _alive(pid)] == [], log.read_text()
    assert not _healthy(base) and not _healthy(f"http://127.0.0.1:{first}")


def test_the_replicas_command_fronts_worker_urls_it_did_not_start(replicas, tmp_path):
    a, b, _ = replicas
    proc, base, log = _launch(tmp_path, "--worker-urls", f"{a.base},{b.base}", "--policy", "round_robin")
    try:
        for i in range(2):
            out = _post(
                base + "/v1/chat/completions",
                {"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 2},
            )
            assert out["usage"]["completion_tokens"] >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _healthy(a.base) and _healthy(b.base)  # not ours to stop


def test_the_replicas_command_exits_1_when_the_router_dies(replicas, tmp_path):
    a, b, _ = replicas
    proc, _, log = _launch(tmp_path, "--worker-urls", f"{a.base},{b.base}")
    try:
        (router,) = _children(proc.pid)
        os.kill(router, signal.SIGKILL)
        assert proc.wait(timeout=30) == 1, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "the router exited with -9" in log.read_text()
    assert _healthy(a.base) and _healthy(b.base)
