"""guidellm (vLLM's serving benchmark, pip `guidellm`, run as it is through its CLI) against the
real server started with default arguments: a short synthetic streaming benchmark must complete
every request and report TTFT and inter-token latency, offline.

Served as `hybridserve serve <the demo model's folder>`: the served model name is then that path
(vLLM's default), and guidellm's default tokenizer (the model name, for its synthetic prompts)
loads from it without a model hub.

guidellm is not in the test dependencies: it pulls ~35 packages, and sanic's `multidict<7` would
downgrade aiohttp's multidict in the project's environment. `make test` installs it into an
environment of its own, `.venv-guidellm` (which sees `.venv`'s packages through a .pth file; see
the Makefile); `HYBRIDSERVE_GUIDELLM` names another guidellm binary. Without any, the test skips.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from hybridserve.model.demo import ensure_demo_model
from server_fixtures import ServerProcess, assert_idle

_OWN_ENV = Path(__file__).resolve().parents[2] / ".venv-guidellm" / "bin" / "guidellm"
GUIDELLM = (
    os.environ.get("HYBRIDSERVE_GUIDELLM")
    or (str(_OWN_ENV) if _OWN_ENV.exists() else None)
    or shutil.which("guidellm")
)
REQUESTS = 4

pytestmark = pytest.mark.skipif(
    not GUIDELLM,
    reason="guidellm not installed (make test installs it into .venv-guidellm; see the docstring)",
)


def test_guidellm_streams_a_synthetic_benchmark_and_reports_ttft_and_itl(tmp_path):
    assert GUIDELLM is not None
    model_dir = ensure_demo_model()
    srv = ServerProcess(model=model_dir)  # every server flag at its default
    try:
        srv.wait_ready()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        result = tmp_path / "benchmarks.json"
        cmd = [
            GUIDELLM,
            "run",
            "--backend",
            f"kind=openai_http,target={srv.base}",
            "--profile",
            "kind=synchronous",
            "--constraint",
            f"kind=max_requests,count={REQUESTS}",
            "--data",
            "kind=synthetic_text,prompt_tokens=32,output_tokens=8",
            "--output",
            f"kind=json,path={result}",
            "--disable-console-interactive",
        ]
        run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        (bench,) = json.loads(result.read_text())["benchmarks"]
        metrics = bench["metrics"]
        assert metrics["request_totals"] == {
            "successful": REQUESTS,
            "errored": 0,
            "incomplete": 0,
            "total": REQUESTS,
        }
        ttft = metrics["time_to_first_token_ms"]["successful"]
        itl = metrics["inter_token_latency_ms"]["successful"]
        assert ttft["count"] == REQUESTS and ttft["mean"] > 0
        assert itl["count"] > 0 and itl["mean"] > 0  # streamed: several chunks per request
        assert metrics["output_token_count"]["successful"]["mean"] == 8
        assert_idle(srv)
        log = srv.output()
        # it speaks the dialect the server knows: no field of its was ignored
        assert "ignored unknown fields" not in log, log[-3000:]
        assert log.count('"POST /v1/chat/completions" 200 ') == REQUESTS, log[-3000:]
    finally:
        rc = srv.stop()
    assert rc == 0
    srv.remove_log()
