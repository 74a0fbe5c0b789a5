"""`hybridserve serve --chat-template`: the chat routes render with the template given (a file),
/tokenizer_info shows it, and a template that is neither a file nor Jinja stops the start; and
the other vLLM serve flags that name the chat side (tool parser, auto tool choice, remote code)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridserve.cli import build_parser
from hybridserve.engine.chat_template import encode_rendered
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


REQUEST_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_a_request_template_is_rendered_only_when_the_server_trusts_it() -> None:
    """`--trust-request-chat-template` (vLLM's flag): a chat request's own `chat_template` is
    rendered in place of the served one, with the model's BOS text, on the chat route and
    /tokenize; one that is not Jinja, or that rejects the messages, is a 400 naming it, and the
    server goes on serving. Without the flag the field is refused, naming the flag."""
    demo = ensure_demo_model()
    tok = Tokenizer(demo)
    with running_server("--dtype", "float32", "--trust-request-chat-template") as server:
        want = encode_rendered(
            tok, f"{tok.bos_token or ''}<system>Be brief.<user>How long does the cake bake?<assistant>"
        )
        status, out = call(server, "/tokenize", {"messages": MESSAGES, "chat_template": REQUEST_TEMPLATE})
        assert status == 200, out
        assert out["tokens"] == want
        status, served = call(server, "/tokenize", {"messages": MESSAGES})
        assert status == 200 and served["tokens"] != want  # (the served template otherwise)
        body = {"model": "demo", "messages": MESSAGES, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        status, out = call(server, "/v1/chat/completions", {**body, "chat_template": REQUEST_TEMPLATE})
        assert status == 200, out
        assert out["usage"]["prompt_tokens"] == len(want)
        call_ids = out["choices"][0]["message"]["content"]
        for bad, what in (
            ("{% for m in messages %}", "is not a valid Jinja template"),
            # nested deeper than Python's own compiler takes (SyntaxError, RecursionError)
            ("{% for a in messages %}" * 25 + "{% endfor %}" * 25, "is not a valid Jinja template"),
            ("{{ " + "(" * 2000 + "1" + ")" * 2000 + " }}", "is not a valid Jinja template"),
            ("{{ raise_exception('no system messages') }}", "the chat template rejected the messages"),
            (7, "must be a non-empty string"),
            ("  ", "must be a non-empty string"),
        ):
            status, err = call(server, "/v1/chat/completions", {**body, "chat_template": bad})
            assert status == 400 and err["error"]["param"] == "chat_template", (bad, err)
            assert what in err["error"]["message"], (bad, err)
        status, again = call(server, "/v1/chat/completions", {**body, "chat_template": REQUEST_TEMPLATE})
        assert status == 200 and again["choices"][0]["message"]["content"] == call_ids
        status, doc = call(server, "/openapi.json")
        assert status == 200
        schema = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]["chat_template"]
        assert "string" in schema["type"]  # (refused fields allow only absent or empty values)
    with running_server("--dtype", "float32") as server:
        status, err = call(server, "/tokenize", {"messages": MESSAGES, "chat_template": REQUEST_TEMPLATE})
        assert status == 400 and err["error"]["param"] == "chat_template"
        assert "--trust-request-chat-template" in err["error"]["message"]
        status, out = call(server, "/tokenize", {"messages": MESSAGES})
        assert status == 200 and out["tokens"] == served["tokens"]


def test_nvidia_command_lines_start_with_the_built_in_parsers() -> None:
    """The vLLM command lines NVIDIA gives for its Nemotron models name plugin files with the
    parsers: the files are not run (a warning names them), and the built-in parsers of those
    names are used; the state dtype flag is taken in its underscore spelling."""
    with running_server(
        "--dtype",
        "float32",
        "--trust-remote-code",
        "--mamba_ssm_cache_dtype",  # (vLLM's parser takes underscores, and the cards write them)
        "float32",
        "--enable-auto-tool-choice",
        "--reasoning-parser-plugin",
        "nano_v3_reasoning_parser.py",
        "--reasoning-parser",
        "nano_v3",
        "--tool-parser-plugin",
        "nemotron_toolcall_parser_no_streaming.py",
        "--tool-call-parser",
        "nemotron_json",
    ) as server:
        status, tok = call(
            server,
            "/tokenize",
            {
                "messages": MESSAGES,
                "tools": [{"type": "function", "function": {"name": "now"}}],
                "return_token_strs": True,
            },
        )
        assert status == 200 and "AVAILABLE_TOOLS" in "".join(tok["token_strs"])  # (nemotron_json's)
        out = server.output()
        assert "--reasoning-parser-plugin nano_v3_reasoning_parser.py: not run" in out
        assert "the built-in parser 'nano_v3' is used" in out
        assert "--tool-parser-plugin nemotron_toolcall_parser_no_streaming.py: not run" in out
        assert "Mamba states in float32 (--mamba-ssm-cache-dtype)" in out
