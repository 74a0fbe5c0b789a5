"""Reasoning outputs (server/reasoning.py): the split of a whole answer, and a stream cut at every
place adds up to it; and against a real server with --reasoning-parser deepseek_r1, serving the
demo model with `</think>` as one token of its vocabulary: chat answers, streamed or not, are the
split of the text the same request completes to."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hybridserve.model.demo import ensure_demo_model
from hybridserve.server.reasoning import ReasoningSplitter, reasoning_format, split_reasoning
from server_fixtures import ServerProcess, assert_idle, call, running_server

R1 = reasoning_format("deepseek_r1")


@pytest.mark.parametrize(
    "text, reasoning, content",
    [
        ("<think>plan</think>answer", "plan", "answer"),
        (" \n<think>\nplan</think>\n\nanswer", "\nplan", "\n\nanswer"),
        ("plan</think>answer", "plan", "answer"),  # the prompt ended with <think>
        ("still thinking", "still thinking", ""),  # cut off while thinking
        ("<thi", "<thi", ""),
        ("<think>", "", ""),
        ("", "", ""),
        ("a</think>b</think>c", "a", "b</think>c"),  # the first end tag ends the reasoning
        ("</think>", "", ""),
        ("x <think>y</think>z", "x <think>y", "z"),  # a tag that does not open the answer is text
    ],
)
def test_a_whole_answer_is_split_at_its_first_end_tag(text, reasoning, content):
    assert split_reasoning(R1, text) == (reasoning, content)
    # NVIDIA's names for its Nemotron Nano plugins split the same way
    for name in ("nano_v2", "nano_v3"):
        assert split_reasoning(reasoning_format(name), text) == (reasoning, content)


def test_a_stream_cut_anywhere_adds_up_to_the_whole_split():
    rng = random.Random(0)
    pieces = ["<think>", "</think>", "<th", "</thi", "nk>", "<", ">", "\n", " ", "plan", "answer", "</", "k"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        splitter = ReasoningSplitter(R1)
        got_r, got_c, last = "", "", 0
        for i, cut in enumerate([*cuts, len(text)]):
            r, c = splitter.feed(text[last:cut], final=i == len(cuts))
            got_r, got_c, last = got_r + r, got_c + c, cut
        assert (got_r, got_c) == split_reasoning(R1, text), (text, cuts)


# ------------------------------------------------------------------------- the server

END_ID = 794  # the demo vocabulary's " Please", made `</think>` in the test's copy


def thinking_demo(folder: Path) -> Path:
    """The demo model with `</think>` in place of one of its tokens (id END_ID)."""
    src = Path(ensure_demo_model())
    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, folder / f.name)
    tj = json.loads((folder / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    [old] = [t for t, i in vocab.items() if i == END_ID]
    del vocab[old]
    vocab["</think>"] = END_ID
    tj["model"]["merges"] = [m for m in tj["model"]["merges"] if "".join(m) != old]
    tj["added_tokens"].append(
        {"id": END_ID, "content": "</think>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": False}
    )  # fmt: skip
    (folder / "tokenizer.json").write_text(json.dumps(tj))
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = thinking_demo(tmp_path_factory.mktemp("thinking"))
    with running_server(
        "--max-model-len", "512", "--reasoning-parser", "deepseek_r1", model=str(model)
    ) as srv:
        yield srv


CHAT = [{"role": "user", "content": "Think, then answer."}]
# sampled, with the end tag made likely enough to come up inside the answer
PARAMS = {"max_tokens": 24, "temperature": 1.0, "ignore_eos": True, "logit_bias": {str(END_ID): 5}}


def raw_answer(server: ServerProcess, body: dict[str, Any]) -> str:
    """What the chat request completes to, as text: the same prompt through /v1/completions."""
    keys = ("messages", "tools", "continue_final_message", "add_generation_prompt")
    _, tok = call(server, "/tokenize", {k: v for k, v in body.items() if k in keys})
    completion = {k: v for k, v in body.items() if k not in (*keys, "stream")}
    status, done = call(server, "/v1/completions", {**completion, "prompt": tok["tokens"]})
    assert status == 200, done
    return str(done["choices"][0]["text"])


def streamed(events: list[Any]) -> tuple[str, str, str]:
    """(reasoning, reasoning_content, content) a chat stream adds up to."""
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    return tuple(
        "".join(d.get(k) or "" for d in deltas) for k in ("reasoning", "reasoning_content", "content")
    )  # type: ignore[return-value]


def test_chat_answers_are_split_where_their_text_ends_its_reasoning(server):
    seeds = [
        s
        for s in range(40)
        if 0 < raw_answer(server, {"messages": CHAT, "seed": s, **PARAMS}).find("</think>") < 40
    ]
    assert seeds, "no seed gave an answer with reasoning before its end tag"
    for seed in seeds[:2]:
        body = {"messages": CHAT, "seed": seed, **PARAMS}
        raw = raw_answer(server, body)
        at = raw.index("</think>")
        status, chat = call(server, "/v1/chat/completions", body)
        assert status == 200
        message = chat["choices"][0]["message"]
        assert message["reasoning"] == message["reasoning_content"] == raw[:at]
        assert message["content"] == (raw[at + len("</think>") :] or None)
        status, events = call(server, "/v1/chat/completions", {**body, "stream": True})
        assert status == 200 and events[-1] == "[DONE]"
        assert streamed(events) == (message["reasoning"], message["reasoning"], message["content"] or "")
        # no chunk for a delta whose text was all held back
        assert all(c["delta"] or c["finish_reason"] for e in events[:-1] for c in e["choices"])
        # with tools offered (no call made), the content after the reasoning is what they parse
        tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
        tooled = {**body, "tools": tools}
        raw_tooled = raw_answer(server, tooled)
        _, events = call(server, "/v1/chat/completions", {**tooled, "stream": True})
        r, _, c = streamed(events)
        _, whole = call(server, "/v1/chat/completions", tooled)
        assert (r, c) == split_reasoning(R1, raw_tooled)
        assert (whole["choices"][0]["message"]["reasoning"] or "") == r
    assert_idle(server)


def test_an_answer_that_closes_its_reasoning_at_once_has_null_reasoning_streamed_or_not(server):
    body = {"messages": CHAT, "max_tokens": 3, "temperature": 0, "logit_bias": {str(END_ID): 100}}
    assert raw_answer(server, body).startswith("</think>")
    status, chat = call(server, "/v1/chat/completions", body)
    assert status == 200
    message = chat["choices"][0]["message"]
    assert message["reasoning"] is None and message["reasoning_content"] is None, message
    status, events = call(server, "/v1/chat/completions", {**body, "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    deltas = [c["delta"] for e in events[:-1] for c in e["choices"]]
    assert not any(d.get("reasoning") or d.get("reasoning_content") for d in deltas), deltas
    assert (streamed(events)[2] or None) == message["content"]


def test_an_answer_cut_off_while_thinking_is_all_reasoning_and_thinking_off_leaves_it_whole(server):
    body = {"messages": CHAT, "seed": 1, **PARAMS, "logit_bias": {str(END_ID): -100}}
    raw = raw_answer(server, body)
    _, chat = call(server, "/v1/chat/completions", body)
    message = chat["choices"][0]["message"]
    assert message["reasoning"] == raw and message["content"] is None
    off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    _, whole = call(server, "/v1/chat/completions", off)
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": raw}


def test_a_grammar_constrains_the_answer_after_its_reasoning(server):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    seeds = [
        s
        for s in range(40)
        if 0 < raw_answer(server, {"messages": CHAT, "seed": s, **PARAMS}).find("</think>") < 40
    ]
    assert seeds
    body = {"messages": CHAT, "seed": seeds[0], **PARAMS, "max_tokens": 60, "response_format": fmt}
    status, chat = call(server, "/v1/chat/completions", body)
    assert status == 200, chat
    message = chat["choices"][0]["message"]
    # the reasoning is free text (the grammar would have begun it with "{"), the content the JSON
    assert message["reasoning"] and not message["reasoning"].lstrip().startswith("{")
    assert 0 <= json.loads(message["content"])["n"] <= 99 and chat["choices"][0]["finish_reason"] == "stop"
    _, events = call(server, "/v1/chat/completions", {**body, "stream": True})
    assert streamed(events) == (message["reasoning"], message["reasoning"], message["content"])
    # with thinking off the whole answer is the JSON
    off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    status, whole = call(server, "/v1/chat/completions", off)
    assert status == 200 and "reasoning" not in whole["choices"][0]["message"]
    assert 0 <= json.loads(whole["choices"][0]["message"]["content"])["n"] <= 99
    assert_idle(server)


def test_a_prompt_that_closed_the_reasoning_gets_all_content_and_one_inside_it_reasoning_first(server):
    # a template's no-thinking mode ends the prompt with an empty reasoning part; here an assistant
    # message continued after its reasoning does the same
    for written in ("<think>short</think>", "<think>short</think>The answer is"):
        closed = [*CHAT, {"role": "assistant", "content": written}]
        body = {"messages": closed, "continue_final_message": True, "seed": 3, **PARAMS}
        raw = raw_answer(server, {**body, "add_generation_prompt": False})
        _, chat = call(server, "/v1/chat/completions", body)
        assert chat["choices"][0]["message"] == {"role": "assistant", "content": raw}, written
    # continued inside its reasoning: the answer goes on with the reasoning until its end tag
    inside = [*CHAT, {"role": "assistant", "content": "<think>first,"}]
    seeds = [
        s
        for s in range(40)
        if 0 < raw_answer(server, {**body, "messages": inside, "seed": s}).find("</think>")
    ]
    assert seeds
    body = {**body, "messages": inside, "seed": seeds[0]}
    raw = raw_answer(server, body)
    _, chat = call(server, "/v1/chat/completions", body)
    message = chat["choices"][0]["message"]
    assert (message["reasoning"], message["content"] or "") == split_reasoning(R1, raw)
    assert message["reasoning"] == raw[: raw.index("</think>")]


def test_the_openai_client_reads_the_reasoning(server):
    import openai

    seeds = [
        s
        for s in range(40)
        if 0 < raw_answer(server, {"messages": CHAT, "seed": s, **PARAMS}).find("</think>")
    ]
    assert seeds
    raw = raw_answer(server, {"messages": CHAT, "seed": seeds[0], **PARAMS})
    reasoning, content = split_reasoning(R1, raw)
    kw: dict[str, Any] = {k: v for k, v in PARAMS.items() if k in ("max_tokens", "temperature", "logit_bias")}
    kw.update(messages=CHAT, seed=seeds[0], extra_body={"ignore_eos": True})
    with openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        model = client.models.list().data[0].id
        message = client.chat.completions.create(model=model, **kw).choices[0].message
        assert message.content == content and (message.model_extra or {})["reasoning_content"] == reasoning
        deltas = [
            c.choices[0].delta
            for c in client.chat.completions.create(model=model, stream=True, **kw)
            if c.choices
        ]
    assert "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content


def test_a_response_holds_the_reasoning_as_its_own_item(server):
    seeds = [
        s
        for s in range(40)
        if 0 < raw_answer(server, {"messages": CHAT, "seed": s, **PARAMS}).find("</think>") < 20
    ]
    assert seeds
    raw = raw_answer(server, {"messages": CHAT, "seed": seeds[0], **PARAMS})
    reasoning, content = split_reasoning(R1, raw)
    body = {"input": CHAT[0]["content"], "seed": seeds[0], "max_output_tokens": PARAMS["max_tokens"],
            **{k: PARAMS[k] for k in ("temperature", "ignore_eos", "logit_bias")}}  # fmt: skip
    status, whole = call(server, "/v1/responses", body)
    assert status == 200, whole
    assert [i["type"] for i in whole["output"]] == ["reasoning", "message"]
    assert whole["output"][0]["content"] == [{"type": "reasoning_text", "text": reasoning}]
    assert whole["output"][1]["content"][0]["text"] == content
    # the reasoning's tokens are the answer's own, up to the end tag's (its text encoded again
    # counted fewer)
    _, tok = call(server, "/tokenize", {"messages": CHAT})
    same = {k: v for k, v in body.items() if k not in ("input", "max_output_tokens")}
    _, done = call(
        server,
        "/v1/completions",
        {**same, "prompt": tok["tokens"], "max_tokens": PARAMS["max_tokens"], "return_token_ids": True},
    )
    ids = done["choices"][0]["token_ids"]
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == ids.index(END_ID) + 1
    assert whole["usage"]["output_tokens"] == len(ids)
    status, events = call(server, "/v1/responses", {**body, "stream": True})
    assert status == 200
    for kind, text in (("reasoning_text", reasoning), ("output_text", content)):
        assert "".join(e["delta"] for e in events if e["type"] == f"response.{kind}.delta") == text
    final = events[-1]["response"]

    def without_ids(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in item.items() if k != "id"} for item in output]

    assert without_ids(final["output"]) == without_ids(whole["output"]) and final["usage"] == whole["usage"]
    assert_idle(server)


def test_an_answer_of_reasoning_alone_is_continued_alike_by_id_and_by_its_items(server):
    """A response whose answer is all reasoning (no end tag within its tokens), continued by
    `previous_response_id` and by its output items sent back: the same conversation (an empty
    assistant turn both ways; sent back, the turn was left out)."""
    status, first = call(
        server, "/v1/responses", {"input": "Think.", "max_output_tokens": 3, "temperature": 0}
    )
    assert status == 200 and [i["type"] for i in first["output"]] == ["reasoning"], first
    by_id = {"input": "more", "previous_response_id": first["id"], "max_output_tokens": 1}
    items = [{"role": "user", "content": "Think."}, *first["output"], {"role": "user", "content": "more"}]
    _, a = call(server, "/v1/responses", by_id)
    _, b = call(server, "/v1/responses", {"input": items, "max_output_tokens": 1})
    assert a["usage"]["input_tokens"] == b["usage"]["input_tokens"], (a, b)
