"""`hybridserve serve --chat-template`: the chat routes render with the template given (a file),
/tokenizer_info shows it, and a template that is neither a file nor Jinja stops the start; and
the other vLLM serve flags that name the chat side (tool parser, auto tool choice, remote code)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridserve.cli import build_parser
from hybridserve.engine.tokenizer import Tokenizer
from hybridserve.model.demo import ensure_demo_model
from server_fixtures import ServerProcess, call, running_server

TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "How long does the cake bake?"},
]


def test_chat_routes_render_with_the_given_template(tmp_path: Path) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    want = Tokenizer(ensure_demo_model()).encode(
        "[system] Be brief.\n[user] How long does the cake bake?\n[assistant]"
    )
    with running_server("--dtype", "float32", "--chat-template", str(path)) as server:
        status, tok = call(server, "/tokenize", {"messages": MESSAGES})
        assert status == 200, tok
        assert tok["tokens"] == want
        status, out = call(
            server,
            "/v1/chat/completions",
            {"model": "demo", "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
        )
        assert status == 200, out
        assert out["usage"]["prompt_tokens"] == len(want)
        assert out["usage"]["completion_tokens"] == 4
        status, info = call(server, "/tokenizer_info")
        assert status == 200 and info["chat_template"] == TEMPLATE


def test_a_chat_template_that_is_neither_file_nor_template_stops_the_start(tmp_path: Path) -> None:
    srv = ServerProcess("--chat-template", str(tmp_path / "missing.jinja"))
    try:
        rc = srv.wait_exit(120)
        assert rc == 2, srv.output()[-2000:]
        assert "--chat-template: " in srv.output() and "neither a file nor a Jinja template" in srv.output()
    finally:
        srv.stop()
        srv.remove_log()


def test_vllm_tool_and_trust_flags_are_accepted_and_unknown_parsers_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """vLLM command lines that name these flags start here too: the hermes parser is the one there
    is, auto tool choice is always on, and no code from a model folder is ever run."""
    ns = build_parser().parse_args(
        ["serve", "demo", "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--trust-remote-code"]
    )
    assert (ns.tool_call_parser, ns.enable_auto_tool_choice, ns.trust_remote_code) == ("hermes", True, True)
    assert build_parser().parse_args(["serve", "demo"]).tool_call_parser == "hermes"
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "demo", "--tool-call-parser", "llama3_json"])
    assert e.value.code == 2
    assert "invalid choice: 'llama3_json'" in capsys.readouterr().err
