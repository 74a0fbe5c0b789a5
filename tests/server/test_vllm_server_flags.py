"""vLLM's server flags that a command line written for vLLM carries, through the real server:
`--response-role` (and vLLM's rule that an answer without a generation prompt takes the last
message's role), `--enable-force-include-usage`, `--disable-uvicorn-access-log`,
`--uvicorn-log-level`, the flags accepted for what is always on here
(`--enable-prompt-tokens-details`, `--enable-request-id-headers`), `-pp 1` / `-dp 1` (and their
refusal above 1), and `--gpu-memory-utilization` (no effect on the CPU, said at start)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from server_fixtures import ServerProcess, call, running_server

MESSAGES = [{"role": "user", "content": "Hello there"}]
VLLM_LINE = (
    "--dtype", "float32",
    "--response-role", "narrator",
    "--enable-force-include-usage",
    "--disable-uvicorn-access-log",
    "--enable-prompt-tokens-details",
    "--enable-request-id-headers",
    "--pipeline-parallel-size", "1",
    "-dp", "1",
    "--gpu-memory-utilization", "0.9",
)  # fmt: skip


@pytest.fixture(scope="module")
def server() -> Any:
    with running_server(*VLLM_LINE) as srv:
        yield srv


def _chat(server: ServerProcess, **body: Any) -> tuple[int, Any]:
    return call(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, **body})


def test_the_answer_takes_the_response_role(server: ServerProcess) -> None:
    status, out = _chat(server)
    assert status == 200 and out["choices"][0]["message"]["role"] == "narrator"
    status, events = _chat(server, stream=True)
    roles = [c["delta"].get("role") for e in events if isinstance(e, dict) for c in e["choices"]]
    assert status == 200 and roles[0] == "narrator" and set(roles[1:]) == {None}
    # the answer sent back in the conversation's history is an assistant message
    history = [*MESSAGES, out["choices"][0]["message"], {"role": "user", "content": "And then?"}]
    status, again = call(server, "/v1/chat/completions", {"messages": history, "max_tokens": 2})
    assert status == 200 and again["choices"][0]["message"]["role"] == "narrator"
    status, tok = call(server, "/tokenize", {"messages": history})
    status_a, tok_a = call(
        server, "/tokenize", {"messages": [*MESSAGES, {**history[1], "role": "assistant"}, history[2]]}
    )
    assert status == status_a == 200 and tok["tokens"] == tok_a["tokens"]
    status, doc = call(server, "/openapi.json")
    assert "narrator" in doc["components"]["schemas"]["ChatMessage"]["properties"]["role"]["enum"]
    # a beam search's choices too
    status, out = _chat(server, use_beam_search=True, n=2)
    assert status == 200 and {c["message"]["role"] for c in out["choices"]} == {"narrator"}


def test_a_response_role_that_is_a_role_already_renames_nothing() -> None:
    from hybridserve.server import protocol as P

    msgs = [{"role": "user", "content": "a"}, {"role": "narrator", "content": "b"}]
    assert [m["role"] for m in P._parse_messages(msgs, answer_role="narrator")] == ["user", "assistant"]
    assert [m["role"] for m in P._parse_messages(msgs[:1], answer_role="user")] == ["user"]


def test_without_a_generation_prompt_the_last_message_s_role(server: ServerProcess) -> None:
    """As vLLM's: the answer continues the conversation as its last speaker."""
    continued = [*MESSAGES, {"role": "assistant", "content": "Hi, I"}]
    status, out = call(
        server,
        "/v1/chat/completions",
        {
            "messages": continued,
            "max_tokens": 3,
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    )
    assert status == 200 and out["choices"][0]["message"]["role"] == "assistant"
    status, out = _chat(server, add_generation_prompt=False)
    assert status == 200 and out["choices"][0]["message"]["role"] == "user"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_every_stream_ends_with_its_usage(server: ServerProcess, path: str) -> None:
    body: dict[str, Any] = {"max_tokens": 4, "stream": True, "ignore_eos": True}
    body.update({"prompt": "Once upon a time"} if path == "/v1/completions" else {"messages": MESSAGES})
    for extra in ({}, {"stream_options": {"include_usage": False}}):
        status, events = call(server, path, {**body, **extra})
        assert status == 200
        chunks = [e for e in events if isinstance(e, dict)]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
        assert all(c.get("usage") is None for c in chunks[:-1])  # (not continuous usage)
    # continuous_usage_stats asks for the usage in every chunk, and the flag includes the usage
    status, events = call(server, path, {**body, "stream_options": {"continuous_usage_stats": True}})
    chunks = [e for e in events if isinstance(e, dict)]
    assert status == 200 and all(c.get("usage") is not None for c in chunks)
    status, out = call(server, path, {**body, "stream": False})
    assert status == 200 and "cached_tokens" in out["usage"]["prompt_tokens_details"]


def test_the_access_lines_are_off_and_the_memory_fraction_is_explained(server: ServerProcess) -> None:
    assert _chat(server)[0] == 200
    out = server.output()
    assert "hybridserve.access" not in out
    assert "--gpu-memory-utilization 0.9 changes nothing on the CPU" in out


def test_uvicorn_log_level_quiets_the_http_layer_only() -> None:
    with running_server("--dtype", "float32", "--uvicorn-log-level", "warning") as srv:
        assert call(srv, "/v1/models")[0] == 200
        assert call(srv, "/v1/models/other")[0] == 404
        out = srv.output()
    assert "hybridserve.access" not in out
    assert "code=model_not_found" in out  # (the client-error line is the server's, not the HTTP layer's)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (("-pp", "2"), "--tensor-parallel-size"),
        (("--data-parallel-size", "2"), "hybridserve replicas"),
        (("--gpu-memory-utilization", "1.5"), "(0, 1]"),
        (("--gpu-memory-utilization", "0.9", "--device", "cuda"), "--cache-memory"),
        (("--response-role", ""), "--response-role"),
    ],
)
def test_what_cannot_be_served_stops_the_start(flags: tuple[str, ...], said: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hybridserve", "serve", "demo", "--port", "0", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert said in proc.stderr


def test_a_config_file_s_flags_reach_the_server(tmp_path: Any) -> None:
    """`serve --config FILE` (vLLM's): the file's flags, server and engine alike."""
    path = tmp_path / "serve.yaml"
    path.write_text("served-model-name: [tiny, demo]\nmax_logprobs: 3\nresponse-role: bot\ndtype: float32\n")
    with running_server("--config", str(path)) as srv:
        status, models = call(srv, "/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == ["tiny", "demo"]
        status, out = call(
            srv, "/v1/chat/completions", {"model": "demo", "messages": MESSAGES, "max_tokens": 2}
        )
        assert status == 200 and out["model"] == "tiny" and out["choices"][0]["message"]["role"] == "bot"
        status, err = call(srv, "/v1/completions", {"model": "tiny", "prompt": "Hi", "logprobs": 4})
        assert status == 400 and err["error"]["param"] == "logprobs"
