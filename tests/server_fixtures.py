"""Helpers of the server tests: a real `hybridserve serve` subprocess, free ports, SSE parsing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from hybridserve.engine.chat_template import ChatTemplate
from hybridserve.model.demo import ensure_demo_model

ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TokenizerModelInfo:
    """protocol.ModelInfo over a real tokenizer folder (the demo model's), for parsing tests."""

    def __init__(self, model_dir: str, max_model_len: int = 64, max_logprobs: int = 20) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self.template = ChatTemplate.from_model_dir(model_dir)
        self._max_model_len = max_model_len
        self._max_logprobs = max_logprobs

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def vocab_size(self) -> int | None:
        return int(self.tokenizer.get_vocab_size())

    @property
    def max_logprobs(self) -> int:
        return self._max_logprobs

    @property
    def response_role(self) -> str:
        return "assistant"

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        return {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_many(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [self.encode(t, add_special_tokens) for t in texts]

    def text_offsets(self, text: str, token_ids: list[int]) -> list[int] | None:
        return None  # (the server's, app.EngineModelInfo, is tested against the real server)

    def min_tokens(self, text: str) -> int:
        return 0  # no bound: every text is tokenized (the server's bound is tested against it)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        *,
        add_special_tokens: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        refuse: Callable[[str], None] | None = None,
        continue_final_message: bool = False,
        template: ChatTemplate | None = None,
    ) -> list[int]:
        text = (template or self.template).render(
            messages, add_generation_prompt, template_kwargs, continue_final_message=continue_final_message
        )
        if refuse is not None:
            refuse(text)
        return self.encode(text, add_special_tokens)


class ServerProcess:
    """`python -m hybridserve serve demo --port P ...` in a subprocess (real engine, demo model)."""

    def __init__(
        self,
        *extra_args: str,
        model: str = "demo",
        launcher: Sequence[str] = (),
        tls: ssl.SSLContext | None = None,
        uds: str | None = None,
    ) -> None:
        """`launcher`: a command that runs `-m hybridserve ...` in place of this Python (torchrun
        and its flags). `tls`: the server serves HTTPS (its flags among `extra_args`), and this
        client context trusts its certificate. `uds`: the server listens on this Unix socket
        (`--uds` is added), which `health_status` reaches."""
        self.port = free_port()
        self.tls = tls
        self.uds = uds
        self.base = f"{'http' if tls is None else 'https'}://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="hybridserve-serve-", suffix=".log", delete=False)
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        src = str(ROOT / "python")
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.args = [
            *(launcher or [sys.executable]),
            "-m",
            "hybridserve",
            "serve",
            model,
            "--port",
            str(self.port),
            *(("--uds", uds) if uds is not None else ()),
            *extra_args,
        ]
        self.proc = subprocess.Popen(
            self.args, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT)
        )
        self.log.close()  # the server writes through its own descriptor; output() reads by name
        self.health_seen: list[int] = []

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def health_status(self) -> int | None:
        if self.uds is not None:
            try:
                return unix_http(self.uds, "GET", "/health", timeout=5, tls=self.tls)[0]
            except OSError:
                return None
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=5, context=self.tls) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)
        except (urllib.error.URLError, ConnectionError, OSError):
            return None

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
            status = self.health_status()
            if status is not None:
                self.health_seen.append(status)
                if status == 200:
                    return
            time.sleep(0.05)
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.output()[-4000:]}")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float = 60.0) -> int:
        return self.proc.wait(timeout=timeout)

    def remove_log(self) -> None:
        Path(self.log.name).unlink(missing_ok=True)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


def unix_http(
    path: str,
    method: str,
    target: str,
    body: Any = None,
    timeout: float = 60,
    tls: ssl.SSLContext | None = None,
    host: str = "localhost",
) -> tuple[int, bytes]:
    """(status, body) of one HTTP request over the Unix socket at `path` (Host: localhost, as curl
    --unix-socket sends it, or `host`); HTTPS with `tls` (a certificate for localhost)."""
    import http.client

    class Connection(http.client.HTTPConnection):
        def connect(self) -> None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(timeout)
                sock.connect(path)
                self.sock = sock if tls is None else tls.wrap_socket(sock, server_hostname="localhost")
            except BaseException:
                sock.close()
                raise

    conn = Connection(host, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, target, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def parse_sse(raw: bytes) -> list[Any]:
    """Split an SSE body into its `data:` payloads (JSON objects, or the string "[DONE]").
    Asserts the OpenAI framing: every event is one `data: ` line followed by a blank line, in
    a Responses stream after an `event: ` line naming the payload's type."""
    text = raw.decode("utf-8")
    assert text.endswith("\n\n"), repr(text[-40:])
    events: list[Any] = []
    for block in text.split("\n\n")[:-1]:
        kind = None
        if block.startswith("event: "):
            kind, _, block = block[len("event: ") :].partition("\n")
        assert block.startswith("data: "), repr(block[:80])
        assert "\n" not in block, repr(block[:80])
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
        assert kind is None or kind == events[-1]["type"], (kind, block[:80])
    return events


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {sample name with labels: value} (via prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


def _content_length(raw: bytes) -> int:
    for line in raw.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def raw_http(server: ServerProcess, request: bytes, timeout: float = 30.0) -> tuple[bytes, Any]:
    """Send `request` bytes as they are (what no HTTP client library would send) and read one
    response: (status line and headers, parsed JSON body or the raw body)."""
    host, port = server.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(request)
        raw = b""
        while b"\r\n\r\n" not in raw or len(raw.split(b"\r\n\r\n", 1)[1]) < _content_length(raw):
            chunk = sock.recv(65536)
            if not chunk:
                break
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    try:
        return head, json.loads(body)
    except ValueError:
        return head, body


@contextlib.contextmanager
def running_server(
    *args: str, model: str = "demo", tls: ssl.SSLContext | None = None, uds: str | None = None
) -> Iterator[ServerProcess]:
    """A server with these flags, ready inside the block and stopped after it (SIGTERM); a graceful
    shutdown must exit 0, and the log is kept (for the failure message) when it does not. `tls`,
    `uds`: as ServerProcess's."""
    if model == "demo":
        ensure_demo_model()
    srv = ServerProcess(*args, model=model, tls=tls, uds=uds)
    try:
        srv.wait_ready()
        yield srv
    finally:
        rc = srv.stop()
    assert rc == 0, f"rc={rc} " + srv.output()[-3000:]
    srv.remove_log()


async def post_and_hold(server: ServerProcess, path: str, body: Any) -> asyncio.StreamWriter:
    """Sends a JSON POST on a connection of its own and returns its writer without reading the
    answer: closing it is a client that goes away."""
    data = json.dumps(body).encode()
    _, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n".encode()
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    await writer.drain()
    return writer


def call(server: ServerProcess, path: str, body: Any = None, timeout: float = 120) -> tuple[int, Any]:
    """(status, parsed body) of a GET (no body) or a JSON POST: a streamed answer (`"stream": true`
    in the body) as its parsed SSE events, any other as JSON, an error status too."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            streamed = isinstance(body, dict) and body.get("stream") and int(r.status) == 200
            return int(r.status), parse_sse(raw) if streamed else json.loads(raw)
    except urllib.error.HTTPError as e:
        with e:
            return int(e.code), json.loads(e.read())


def get_metrics(server: ServerProcess) -> dict[str, float]:
    """The server's /metrics, parsed."""
    with urllib.request.urlopen(server.base + "/metrics", timeout=30) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        return parse_metrics(r.read().decode())


def held(m: dict[str, float]) -> dict[str, float]:
    """What requests hold: running/waiting requests, referenced KV blocks, Mamba slots other than
    prefix-cache checkpoints, and the server's own in-flight count."""
    return {
        "running": m["hybridserve_num_requests_running"],
        "waiting": m["hybridserve_num_requests_waiting"],
        "kv_blocks": m["hybridserve_kv_blocks_used"],
        "mamba_windows": m["hybridserve_mamba_slots_used"]
        - m["hybridserve_mamba_checkpoints_committed"]
        - m["hybridserve_mamba_checkpoints_pending"],
        "server_inflight": m["hybridserve_server_inflight_requests"],
    }


def wait_idle(server: ServerProcess, timeout: float = 30.0) -> dict[str, float]:
    """Poll /metrics until requests hold nothing (or give up after `timeout`); the last metrics."""
    deadline = time.monotonic() + timeout
    while True:
        m = get_metrics(server)
        if not any(held(m).values()) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def assert_idle(server: ServerProcess) -> dict[str, float]:
    """Nothing runs or waits, and no KV block or Mamba state slot is held but by the prefix cache's
    committed checkpoints."""
    m = wait_idle(server)
    assert held(m) == {"running": 0, "waiting": 0, "kv_blocks": 0, "mamba_windows": 0, "server_inflight": 0}
    assert m["hybridserve_mamba_checkpoints_pending"] == 0
    return m


def openai_client(server: ServerProcess, timeout: float = 60) -> Any:
    """The official openai client on the server's /v1 (no retries: a failure shows at once); use
    it as a context manager to close its connections."""
    import openai

    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=timeout)


def log_lines(server: ServerProcess, pattern: str, timeout: float = 15.0, count: int = 1) -> list[str]:
    """The server's log lines matching `pattern`, once there are `count` of them."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [ln for ln in server.output().splitlines() if re.search(pattern, ln)]
        if len(lines) >= count or time.monotonic() > deadline:
            assert len(lines) >= count, f"no log line matches {pattern!r}:\n{server.output()[-3000:]}"
            return lines
        time.sleep(0.05)
