"""One `hybridserve serve` subprocess (the demo model or a checkpoint folder) for the benchmarks
that drive the real server: start on a free port, wait for /health, read /metrics and the
process's resident memory, stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name with labels: value}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


class BenchServer:
    """`hybridserve serve MODEL ARGS` on a free port, its output in `log`. `threads`: OMP threads
    of the server's torch (0: the environment's). `model`: "demo" or a checkpoint folder."""

    def __init__(self, args: list[str], log: Path, threads: int = 0, model: str = "demo") -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log
        self.log = log.open("w")
        self.cmd = [sys.executable, "-m", "hybridserve", "serve", model, "--port", str(self.port), *args]
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}: see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server did not become ready in {timeout} s: see {self.log_path}")

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"{self.base}/metrics", timeout=10) as r:
            return parse_metrics(r.read().decode())

    def rss_bytes(self) -> int:
        """Resident memory of the server process (Linux /proc)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS in /proc status")

    def stop(self) -> int | None:
        """SIGTERM (a graceful shutdown), SIGKILL after 60 s; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
