"""`--enable-log-requests` (vLLM's flag): a real server logs a line per generation request's
prompt with its id and the sampling parameters it changed, the prompt escaped and cut to
`--max-log-len`; without the flag (or with vLLM's older `--disable-log-requests`) no prompt is
logged."""

from __future__ import annotations

import json
import urllib.request

from server_fixtures import ServerProcess, call, running_server


def _post(server: ServerProcess, path: str, body: dict[str, object], request_id: str) -> int:
    req = urllib.request.Request(
        server.base + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Request-Id": request_id},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()  # (the whole answer: a stream's last chunk comes after its output line)
        return int(r.status)


def _request_lines(server: ServerProcess) -> list[str]:
    return [line for line in server.output().splitlines() if "hybridserve.requests:" in line]


def test_each_prompt_is_logged_with_its_id_and_changed_parameters_cut_to_max_log_len() -> None:
    with running_server("--enable-log-requests", "--max-log-len", "12") as server:
        text = {
            "prompt": "Hello there\nfriend, how are you",
            "max_tokens": 3,
            "temperature": 0,
            "stop": ["."],
        }
        assert _post(server, "/v1/completions", text, "txt") == 200
        ids = {"prompt": [[5, 6, 7], list(range(10, 40))], "max_tokens": 2}
        assert _post(server, "/v1/completions", ids, "ids") == 200
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "seed": 7}
        assert _post(server, "/v1/chat/completions", chat, "chat") == 200
        assert (
            call(server, "/v1/completions", {"prompt": "x", "max_tokens": 0})[0] == 400
        )  # (refused: no line)
        lines = _request_lines(server)
    assert len(lines) == 4, lines
    by_id = {line.split("request ", 1)[1].split(":", 1)[0]: line for line in lines}
    assert set(by_id) == {"cmpl-txt", "cmpl-ids[0]", "cmpl-ids[1]", "chatcmpl-chat"}
    # the text's first 12 characters, its newline escaped: no forged line
    assert "prompt 'Hello there\\n'... (14 tokens)" in by_id["cmpl-txt"]
    assert "max_tokens=3" in by_id["cmpl-txt"] and "temperature=0" in by_id["cmpl-txt"]
    assert "stop=['.']" in by_id["cmpl-txt"]
    assert "prompt [5, 6, 7] (3 tokens), params: max_tokens=2" in by_id["cmpl-ids[0]"]
    assert "prompt [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, ...] (30 tokens)" in by_id["cmpl-ids[1]"]
    assert "seed=7" in by_id["chatcmpl-chat"] and "tokens), params:" in by_id["chatcmpl-chat"]


def test_without_the_flag_no_prompt_is_logged() -> None:
    with running_server("--disable-log-requests") as server:
        assert _post(server, "/v1/completions", {"prompt": "Secret words", "max_tokens": 2}, "quiet") == 200
        assert not _request_lines(server) and "Secret words" not in server.output()


def test_enable_log_outputs_logs_each_finished_choice() -> None:
    """vLLM's `--enable-log-outputs`: a line per finished choice, streamed or not, with the answer's
    id, the choice's index, its text (escaped, cut to --max-log-len), token count and reason."""
    with running_server("--enable-log-outputs", "--max-log-len", "5", "--dtype", "float32") as server:
        body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 2}
        status, out = call(server, "/v1/completions", body)
        assert status == 200
        streamed = {**body, "n": 1, "stream": True, "max_tokens": 2}
        assert _post(server, "/v1/completions", streamed, "streamed") == 200
        every = _request_lines(server)
    lines = [line for line in every if " output " in line]
    assert len(lines) == 3, lines
    text = out["choices"][0]["text"]
    for i in (0, 1):
        (line,) = [line for line in lines if f"output {out['id']} choice {i}:" in line]
        assert f"{text[:5]!r}... (6 tokens), finish_reason=length" in line
    assert any("output cmpl-streamed choice 0:" in line and "(2 tokens)" in line for line in lines)
    assert len(every) == 3  # (no prompt line: not asked for)
