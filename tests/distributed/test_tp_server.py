"""`hybridserve serve demo -tp 2`: it answers; then its worker is killed with SIGKILL in the
middle of a streamed completion: the stream ends with an error within seconds, the server exits
non-zero, and none of its child processes is left. Under `torchrun --nproc-per-node 2` the two
ranks join torchrun's group, rank 0 serves the tokens of the spawned mode, and a SIGTERM to
torchrun ends every process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.errors import EngineDeadError
from hybridserve.model.demo import ensure_demo_model
from server_fixtures import ServerProcess, free_port


def _children(pid: int) -> dict[int, str]:
    """pid -> command line of every live descendant of `pid` (from /proc)."""
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            parents[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out: dict[int, str] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        for c, pp in parents.items():
            if pp == p and c not in out:
                try:
                    out[c] = Path(f"/proc/{c}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    continue
                todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _post(srv: ServerProcess, body: dict, timeout: float = 60.0):  # type: ignore[no-untyped-def]
    req = urllib.request.Request(
        srv.base + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    return urllib.request.urlopen(req, timeout=timeout)


def test_serve_tp2_then_a_killed_worker_fails_the_stream_and_the_server_exits_nonzero() -> None:
    ensure_demo_model()
    srv = ServerProcess("-tp", "2", "--dtype", "float32", "--cpu-threads", "1")
    try:
        srv.wait_ready()
        with _post(srv, {"prompt": "Hello there", "max_tokens": 5, "temperature": 0}) as r:
            assert r.status == 200 and json.loads(r.read())["choices"][0]["text"]
        kids = _children(srv.proc.pid)
        workers = [p for p, cmd in kids.items() if "spawn_main" in cmd]
        assert len(workers) == 1, kids
        # a Ctrl-C or a service manager's stop reaches the whole group: the worker stays for
        # rank 0's drain (it ends when rank 0 tells it to, or is gone)
        os.kill(workers[0], signal.SIGINT)
        os.kill(workers[0], signal.SIGTERM)
        time.sleep(0.5)
        assert _alive(workers[0])
        with _post(srv, {"prompt": "Hello there", "max_tokens": 5, "temperature": 0}) as r:
            assert r.status == 200 and json.loads(r.read())["choices"][0]["text"]
        body = {"prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
                "stream": True}  # fmt: skip
        with _post(srv, body) as stream:
            assert stream.status == 200
            first = stream.readline()
            assert first.startswith(b"data: {")
            os.kill(workers[0], signal.SIGKILL)
            killed = time.monotonic()
            rest = b""
            while True:
                line = stream.readline()
                if not line:
                    break
                rest += line
            ended = time.monotonic() - killed
        events = [json.loads(x[6:]) for x in rest.splitlines() if x.startswith(b"data: {")]
        assert any("error" in e for e in events), rest[-2000:]
        assert ended < 10.0
        rc = srv.wait_exit(30)
        assert rc != 0
        assert "tensor-parallel worker rank 1" in srv.output()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in kids if _alive(p)], kids
    finally:
        srv.stop()
    srv.remove_log()


def test_torchrun_ranks_serve_the_spawned_mode_tokens_and_sigterm_ends_them_all() -> None:
    ensure_demo_model()
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2"]
    torchrun += ["--master-port", str(free_port())]
    srv = ServerProcess("-tp", "2", "--dtype", "float32", "--cpu-threads", "1", launcher=torchrun)
    prompt, n = "Once upon a time", 12
    try:
        # the spawned mode's tokens, while torchrun's ranks start
        llm = LLM("demo", dtype="float32", tensor_parallel_size=2, cpu_threads=1)
        try:
            ref = llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            llm.engine.stop_workers()  # type: ignore[attr-defined]
            with pytest.raises(EngineDeadError, match="stopped"):  # (no step without its workers)
                llm.generate(prompt, SamplingParams(max_tokens=n))
        finally:
            llm.engine.stop_workers()  # type: ignore[attr-defined]
        srv.wait_ready()
        body = {
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        with _post(srv, body) as r:
            choice = json.loads(r.read())["choices"][0]
        assert choice["token_ids"] == list(ref[0].outputs[0].token_ids)
        assert "joining the 2 ranks torchrun started" in srv.output()
        ranks = {p: cmd for p, cmd in _children(srv.proc.pid).items() if "hybridserve serve" in cmd}
        assert len(ranks) == 2, ranks  # torchrun's two ranks, and no spawned worker
        assert not [cmd for cmd in _children(srv.proc.pid).values() if "spawn_main" in cmd]
        # torchrun forwards the SIGTERM to both ranks: the stream in flight still ends whole
        # (the worker runs rank 0's draining steps)
        with _post(srv, {**body, "max_tokens": 64, "stream": True}) as stream:
            assert stream.readline().startswith(b"data: {")
            srv.signal(signal.SIGTERM)
            rest = stream.read()
        events = [json.loads(x[6:]) for x in rest.splitlines() if x.startswith(b"data: {")]
        assert not [e for e in events if "error" in e], rest[-2000:]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        srv.wait_exit(30)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in ranks if _alive(p)], ranks
    finally:
        srv.stop()
    srv.remove_log()


SCRIPT = """
import sys
from hybridserve import LLM, SamplingParams
from hybridserve.distributed.torchrun import run_worker, torchrun_env

env = torchrun_env()
assert env is not None
if env.rank > 0:
    sys.exit(run_worker(env, "cpu"))
llm = LLM("demo", dtype="float32", tensor_parallel_size=2, cpu_threads=1, max_model_len=256)
out = llm.generate("Once upon a time", SamplingParams(max_tokens=4, temperature=0))
print("generated:", out[0].outputs[0].text)
# (no stop_workers: the script just ends)
"""


def test_an_offline_script_under_torchrun_that_just_ends_ends_its_workers_cleanly(tmp_path: Path) -> None:
    ensure_demo_model()
    script = tmp_path / "offline.py"
    script.write_text(SCRIPT)
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2"]
    cmd += ["--master-port", str(free_port()), str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "generated:" in proc.stdout
    assert "Traceback" not in proc.stderr and "exiting" not in proc.stderr, proc.stderr[-3000:]
