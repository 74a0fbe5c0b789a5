"""What clients written for vLLM need, against one real `hybridserve serve demo`: vLLM's tokenizer
routes (/tokenize, /detokenize, /tokenizer_info; lm-evaluation-harness's remote tokenizer reads
them), vLLM's request fields (continuous usage stats, chat_template_kwargs, unknown fields ignored
with a warning), and what the server logs: an access line per request, a line per 4xx naming the
field and the code, the periodic engine line, the CPU threads at start (docs/serving.md)."""

from __future__ import annotations

import concurrent.futures
import gc
import json
import re
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from hybridserve.engine.chat_template import ChatTemplate
from hybridserve.model.demo import ensure_demo_model
from server_fixtures import (
    ServerProcess,
    TokenizerModelInfo,
    assert_idle,
    call,
    log_lines,
    parse_sse,
    running_server,
)

MAX_MODEL_LEN = 512
PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Say something about foxes."}]
SERVER_ARGS = (
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--mamba-block-size",
    "64",
    "--log-stats-interval",
    "0.5",
)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    ensure_demo_model()
    with running_server(*SERVER_ARGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def info() -> TokenizerModelInfo:
    return TokenizerModelInfo(ensure_demo_model(), max_model_len=MAX_MODEL_LEN)


def stream(server: ServerProcess, path: str, body: dict[str, Any]) -> list[Any]:
    req = urllib.request.Request(
        server.base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        return parse_sse(r.read())


# ------------------------------------------------------------------------- tokenizer routes


def test_tokenize_counts_what_the_generation_routes_run(server, info):
    status, tok = call(server, "/tokenize", {"prompt": PROMPT})
    assert status == 200
    assert tok == {
        "count": len(info.encode(PROMPT)),
        "max_model_len": MAX_MODEL_LEN,
        "tokens": info.encode(PROMPT),
        "token_strs": None,
    }
    _, done = call(server, "/v1/completions", {"model": "demo", "prompt": PROMPT, "max_tokens": 1})
    assert done["usage"]["prompt_tokens"] == tok["count"]

    status, chat_tok = call(server, "/tokenize", {"model": "demo", "messages": CHAT})
    assert status == 200 and chat_tok["tokens"] == info.encode_chat(CHAT, True)
    _, done = call(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1})
    assert done["usage"]["prompt_tokens"] == chat_tok["count"]
    _, open_turn = call(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert open_turn["tokens"] == info.encode_chat(CHAT, False) != chat_tok["tokens"]

    # vLLM's token_strs: the vocabulary's entries
    _, strs = call(server, "/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    assert strs["token_strs"] == [info.tokenizer.id_to_token(t) for t in strs["tokens"]]
    assert call(server, "/tokenize", {"prompt": ""})[1]["count"] == 0

    status, err = call(server, "/tokenize", {"model": "gpt-4", "prompt": "x"})
    assert status == 404 and err["error"]["code"] == "model_not_found"
    status, err = call(server, "/tokenize", {"prompt": "x", "messages": CHAT})
    assert status == 400 and err["error"]["param"] == "prompt"


def test_render_gives_the_tokens_the_generation_routes_run(server, info):
    """vLLM's render routes (cache-aware routers tokenize through them): the prompt tokens the
    generation would run, checked as the generation routes check a request."""
    status, rendered = call(server, "/v1/completions/render", {"model": "demo", "prompt": [PROMPT, "x"]})
    assert status == 200 and [r["token_ids"] for r in rendered] == [info.encode(PROMPT), info.encode("x")]
    assert all(r["request_id"].startswith("cmpl-") and r["model"] == "demo" for r in rendered)
    _, done = call(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "return_token_ids": True})
    assert done["choices"][0]["prompt_token_ids"] == rendered[0]["token_ids"]
    status, chat = call(server, "/v1/chat/completions/render", {"messages": CHAT})
    assert status == 200 and chat["token_ids"] == info.encode_chat(CHAT, True)
    status, err = call(server, "/v1/chat/completions/render", {"messages": CHAT, "max_tokens": -1})
    assert status == 400 and err["error"]["param"] == "max_tokens"
    assert_idle(server)  # nothing reached the engine


def test_a_continued_final_message_is_continued(server, info):
    """vLLM's continue_final_message: the prompt ends inside the final (assistant) message, and
    the answer is the continuation of that text, as a completion of the same prompt gives."""
    messages = [*CHAT, {"role": "assistant", "content": "Foxes are"}]
    body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    status, tok = call(server, "/tokenize", body)
    assert status == 200 and tok["tokens"] == info.encode_chat(messages, False, continue_final_message=True)
    assert info.tokenizer.decode(tok["tokens"], skip_special_tokens=False).endswith("assistant\nFoxes are")
    greedy = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    status, chat = call(server, "/v1/chat/completions", {**body, **greedy, "return_token_ids": True})
    assert status == 200 and chat["prompt_token_ids"] == tok["tokens"]
    _, done = call(server, "/v1/completions", {"prompt": tok["tokens"], **greedy})
    assert chat["choices"][0]["message"]["content"] == done["choices"][0]["text"]
    _, closed = call(
        server, "/v1/chat/completions", {"messages": messages, **greedy, "return_token_ids": True}
    )
    assert len(closed["prompt_token_ids"]) > len(tok["tokens"])  # the closed turn and a new header
    assert_idle(server)


def test_allowed_token_ids_and_bad_words_shape_the_answer(server, info):
    """vLLM's allowed_token_ids and bad_words: the answer holds only allowed tokens and none of a
    bad word's, on both routes, streamed or not."""
    greedy = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    _, free = call(server, "/v1/completions", {"prompt": PROMPT, **greedy})
    free_ids = free["choices"][0]["token_ids"]
    allowed = sorted(set(range(3, info.vocab_size)) - set(free_ids))
    _, only = call(server, "/v1/completions", {"prompt": PROMPT, **greedy, "allowed_token_ids": allowed})
    assert set(only["choices"][0]["token_ids"]) <= set(allowed)
    word = free["choices"][0]["text"].split()[0]
    word_ids = info.encode(" " + word.lstrip())
    assert any(free_ids[i : i + len(word_ids)] == word_ids for i in range(len(free_ids)))
    _, banned = call(server, "/v1/completions", {"prompt": PROMPT, **greedy, "bad_words": [word]})
    banned_ids = banned["choices"][0]["token_ids"]
    body = {"messages": CHAT, **greedy, "bad_words": [word], "stream": True}
    events = stream(server, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    streamed = [t for e in events[:-1] for c in e["choices"] for t in c.get("token_ids") or []]
    assert banned_ids != free_ids and len(streamed) == greedy["max_tokens"]
    for seq in (word_ids, info.encode(word.lstrip())):
        for out in (banned_ids, streamed):
            assert not any(out[i : i + len(seq)] == seq for i in range(len(out))), (seq, out)
    status, err = call(server, "/v1/completions", {"prompt": PROMPT, "allowed_token_ids": [info.vocab_size]})
    assert status == 400 and err["error"]["param"] == "allowed_token_ids"
    assert_idle(server)


def test_truncate_prompt_tokens_runs_the_prompts_last_tokens(server, info):
    ids = info.encode(PROMPT * 40)
    greedy = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    status, cut = call(
        server, "/v1/completions", {"prompt": ids, "truncate_prompt_tokens": 30, "echo": True, **greedy}
    )
    assert status == 200 and cut["usage"]["prompt_tokens"] == 30
    _, direct = call(server, "/v1/completions", {"prompt": ids[-30:], "echo": True, **greedy})
    assert (
        cut["choices"][0]["text"] == direct["choices"][0]["text"]
    )  # the kept tokens echoed, then the answer
    status, err = call(
        server, "/v1/completions", {"prompt": ids, "truncate_prompt_tokens": MAX_MODEL_LEN + 1}
    )
    assert status == 400 and err["error"]["param"] == "truncate_prompt_tokens"
    assert_idle(server)


def test_detokenize_reverses_tokenize_special_tokens_included(server, info):
    text = "<|im_start|>user\nhi there<|im_end|>\n"
    _, tok = call(server, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert 1 in tok["tokens"] and 2 in tok["tokens"]  # <|im_start|>, <|im_end|>
    assert call(server, "/detokenize", {"tokens": tok["tokens"]}) == (200, {"prompt": text})
    assert call(server, "/detokenize", {"model": "demo", "tokens": []}) == (200, {"prompt": ""})
    vocab = info.vocab_size
    status, err = call(server, "/detokenize", {"tokens": [5, vocab]})
    assert status == 400 and err["error"]["param"] == "tokens"
    status, err = call(server, "/detokenize", {})
    assert status == 400 and err["error"]["code"] == "missing_field"


def test_tokenizer_info_is_what_lm_eval_reads(server, info):
    status, tinfo = call(server, "/tokenizer_info")
    assert status == 200
    demo = ensure_demo_model()
    assert tinfo["eos_token"] == "<|im_end|>" and tinfo["bos_token"] == "<|endoftext|>"
    assert tinfo["pad_token"] == "<|endoftext|>"
    assert tinfo["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tinfo["chat_template"] == ChatTemplate.from_model_dir(demo).source
    assert tinfo["added_tokens_decoder"]["2"] == "<|im_end|>"  # (AddedTokens as their text, as vLLM)

    lm_eval_utils = pytest.importorskip("lm_eval.utils")
    base = server.base + "/v1/completions"  # what lm-eval's local-completions is given
    with warnings.catch_warnings():
        # (its probe leaves its requests.Session to the garbage collector)
        warnings.simplefilter("ignore", ResourceWarning)
        assert lm_eval_utils.check_remote_tokenizer_support(base, max_retries=1)
        gc.collect()
    tok = lm_eval_utils.RemoteTokenizer(base, max_retries=1)
    try:
        assert tok.encode(PROMPT) == info.encode(PROMPT)
        assert tok.decode(info.encode(PROMPT)) == PROMPT
        assert tok.eos_token_id == info.tokenizer.token_to_id("<|im_end|>") == 2
        assert tok.bos_token_id == 0
        assert tok.apply_chat_template(CHAT) == info.template.render(CHAT, True)
    finally:
        tok.session.close()


# ------------------------------------------------------------------------- request fields


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server):
    for path, body in (
        ("/v1/completions", {"prompt": PROMPT, "n": 2}),
        ("/v1/chat/completions", {"messages": CHAT}),
    ):
        events = stream(
            server,
            path,
            {**body, "max_tokens": 5, "ignore_eos": True, "stream": True,
             "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        )  # fmt: skip
        assert events[-1] == "[DONE]"
        chunks, last = events[:-2], events[-2]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5 * body.get("n", 1)
        assert all(c["usage"] is not None for c in chunks)
        # each chunk: its choice's tokens so far (as vLLM's), counted up to the choice's 5
        for index in range(body.get("n", 1)):
            seen = [c["usage"]["completion_tokens"] for c in chunks if c["choices"][0]["index"] == index]
            assert seen == sorted(seen) and seen[-1] == 5
        assert {c["usage"]["prompt_tokens"] for c in chunks} == {last["usage"]["prompt_tokens"]}
        # without it, as before: usage only in the last chunk
        plain = stream(
            server, path, {**body, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
        )
        assert all(c["usage"] is None for c in plain[:-2]) and plain[-2]["usage"] is not None
    assert_idle(server)


def test_unknown_fields_are_ignored_and_named_in_the_log(server):
    status, out = call(
        server,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 2, "frobnicate": {"x": 1}, "guided_choice\n": 1,
         "metadata": {"run": "a"}, "store": False, "service_tier": "auto", "user": "u1"},
    )  # fmt: skip
    assert status == 200 and out["usage"]["completion_tokens"] == 2
    line = log_lines(server, r"ignored unknown fields: frobnicate")[-1]
    assert "guided_choice\\n" in line  # (escaped: a field name cannot start a log line)
    events = stream(
        server,
        "/v1/chat/completions",
        {"messages": [{**CHAT[0], "reasoning_content": "hm"}], "max_tokens": 2, "stream": True,
         "stream_options": {"include_usage": True, "bogus": 1}, "chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 2
    line = log_lines(server, r"/v1/chat/completions\": ignored unknown fields: ")[-1]
    assert "messages[0].reasoning_content" in line and "stream_options.bogus" in line
    # known fields keep their types, and the ones this server does not implement are refused
    for path, body, param in (
        ("/v1/completions", {"prompt": "x", "store": "yes"}, "store"),
        ("/v1/completions", {"prompt": "x", "metadata": [1]}, "metadata"),
        # OpenAI's metadata: 16 pairs, keys of 64 characters, string values of 512
        (
            "/v1/chat/completions",
            {"messages": CHAT, "metadata": {f"k{i}": "v" for i in range(17)}},
            "metadata",
        ),
        ("/v1/chat/completions", {"messages": CHAT, "metadata": {"k" * 65: "v"}}, "metadata"),
        ("/v1/chat/completions", {"messages": CHAT, "metadata": {"k": "v" * 513}}, "metadata"),
        ("/v1/chat/completions", {"messages": CHAT, "metadata": {"k": 1}}, "metadata"),
        ("/v1/responses", {"input": "x", "metadata": {"k": "v" * 513}}, "metadata"),
        ("/v1/chat/completions", {"messages": CHAT, "chat_template": "{{ 1 }}"}, "chat_template"),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "chat_template_kwargs": {"messages": []}},
            "chat_template_kwargs",
        ),
    ):
        status, err = call(server, path, body)
        assert status == 400 and err["error"]["param"] == param, (body, err)
    ok = {f"k{i}": "v" * 512 for i in range(16)}
    status, out = call(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "metadata": ok})
    assert status == 200, out
    # a value of megabytes named in an error comes back cut, not whole
    status, err = call(server, "/v1/completions", {"model": "m" * 1_000_000, "prompt": "x"})
    message = err["error"]["message"]
    assert status == 404 and len(message) <= 2000, message[-200:]
    in_all = int(message.rsplit("(cut: ", 1)[1].removesuffix(" characters in all)"))
    assert in_all > 1_000_000, message[-200:]  # the length of the whole message, not of a cut
    assert_idle(server)


# ------------------------------------------------------------------------- logs


def test_access_and_client_error_lines(server):
    call(server, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True})
    pattern = (
        r'hybridserve\.access: 127\.0\.0\.1 "POST /v1/completions" 200 prompt_tokens=3 output_tokens=3 '
        r"cached_tokens=\d+ ttft=\d+\.\d{3}s e2e=\d+\.\d{3}s id=cmpl-[0-9a-f]{32}$"
    )
    log_lines(server, pattern)
    status, _ = call(server, "/v1/completions", {"prompt": "x", "temperature": 9})
    assert status == 400
    log_lines(
        server, r'"POST /v1/completions" 400: param=temperature code=invalid_value: temperature: must be in'
    )
    log_lines(server, r'hybridserve\.access: .*"POST /v1/completions" 400 e2e=')
    call(server, "/nowhere")
    log_lines(server, r'"GET /nowhere" 404: param=- code=not_found')
    # health probes (the fixture polled /health while the model loaded) are at debug level
    assert '"GET /health"' not in server.output()
    assert re.search(r'hybridserve\.access: .*"GET /tokenizer_info" 200 e2e=', server.output())


def _with_request_id(
    server: ServerProcess, path: str, body: dict[str, Any] | None, request_id: str | None
) -> tuple[int, str | None, Any]:
    """(status, the answer's X-Request-Id header, its JSON body) of a request sent with that header."""
    headers = {"Content-Type": "application/json"}
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.base + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers.get("X-Request-Id"), json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.headers.get("X-Request-Id"), json.loads(e.read())


def test_the_request_id_header_names_the_answer_and_comes_back(server):
    body = {"prompt": "The fox", "max_tokens": 4, "temperature": 0}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, payload, prefix in (
        ("/v1/completions", body, "cmpl-"),
        ("/v1/chat/completions", chat, "chatcmpl-"),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "store": False}, "resp_"),
    ):
        status, header, answer = _with_request_id(server, path, payload, "trace-7.a")
        assert (status, header) == (200, "trace-7.a"), path
        if prefix == "resp_":  # (a response is read back by its id: that id is the server's own)
            assert answer["id"].startswith(prefix) and "trace" not in answer["id"]
        else:
            assert answer["id"] == f"{prefix}trace-7.a", path
        # without one, the header names the new id
        status, header, answer = _with_request_id(server, path, payload, None)
        assert status == 200 and header == answer["id"] and header.startswith(prefix)
    log_lines(server, r'"POST /v1/completions" 200 .* id=cmpl-trace-7\.a$')
    # one id on requests running at once (long enough to overlap): each is answered as it is
    # alone (the engine's ids differ)
    body = {**body, "max_tokens": 64, "ignore_eos": True}
    solo = _with_request_id(server, "/v1/completions", body, None)[2]["choices"][0]["text"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(
            pool.map(lambda _: _with_request_id(server, "/v1/completions", body, "same"), range(4))
        )
    assert all(
        a[0] == 200 and a[2]["id"] == "cmpl-same" and a[2]["choices"][0]["text"] == solo for a in answers
    )
    # any route carries the client's id back, errors included; a bad one is refused on generation
    assert _with_request_id(server, "/v1/nowhere", None, "x-1")[:2] == (404, "x-1")
    status, header, err = _with_request_id(server, "/v1/completions", body, "a" * 257)
    assert status == 400 and err["error"]["param"] == "X-Request-Id" and header is None
    assert_idle(server)


def test_engine_line_while_there_is_work_and_threads_at_start(server):
    log_lines(server, r"hybridserve\.engine: CPU threads: 1 \(OMP_NUM_THREADS=1\)")
    before = len(log_lines(server, r"hybridserve\.stats: engine:", timeout=0, count=0))
    call(server, "/v1/completions", {"prompt": PROMPT * 8, "max_tokens": 16, "ignore_eos": True})
    line = log_lines(server, r"hybridserve\.stats: engine:", count=before + 1)[-1]
    assert re.search(
        r"engine: \d+ running, \d+ waiting; prompt \d+\.\d tok/s, generation \d+\.\d tok/s; "
        r"prefix cache hit rate (\d+\.\d%|-) \(since start \d+\.\d%\); KV cache \d+\.\d% used, "
        r"Mamba state slots \d+\.\d% used$",
        line,
    ), line
    # idle: the lines stop after the interval that saw the work end (a busy machine may delay
    # that interval's line: settled is when a whole 1.5 s window adds none; a server that logs
    # while idle never settles)
    deadline = time.monotonic() + 20
    settled = len(log_lines(server, r"hybridserve\.stats: engine:", timeout=0, count=0))
    while True:
        time.sleep(1.5)
        now = len(log_lines(server, r"hybridserve\.stats: engine:", timeout=0, count=0))
        if now == settled:
            break
        assert time.monotonic() < deadline, "the engine lines go on while it is idle"
        settled = now


def test_the_served_name_is_the_model_argument(server):
    assert call(server, "/v1/models")[1]["data"][0]["id"] == "demo"
