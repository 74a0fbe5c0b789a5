"""`hybridserve serve --chat-template`: the chat routes render with the template given (a file),
/tokenizer_info shows it, and a template that is neither a file nor Jinja stops the start."""

from __future__ import annotations

from pathlib import Path

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
