"""vLLM's `use_beam_search` through a real server (float64): the n choices are the n best beams
`LLM.beam_search` finds, on the completion and chat routes and through the `openai` client's
`extra_body`; what a beam search does not serve is a 400 naming the field; nothing is left held."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from hybridserve import LLM, BeamSearchParams
from server_fixtures import (
    ServerProcess,
    assert_idle,
    call,
    get_metrics,
    held,
    log_lines,
    openai_client,
    post_and_hold,
    running_server,
    wait_idle,
)

PROMPT = "The history of the city"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server("--dtype", "float64", "--max-num-seqs", "8") as srv:
        yield srv


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM("demo", dtype="float64", cpu_threads=1)


def test_the_choices_are_the_best_beams(server: ServerProcess, offline: LLM) -> None:
    (want,) = offline.beam_search(PROMPT, BeamSearchParams(beam_width=3, max_tokens=5))
    n_prompt = len(offline.get_tokenizer().encode(PROMPT))
    body: dict[str, Any] = {
        "prompt": PROMPT,
        "n": 3,
        "max_tokens": 5,
        "use_beam_search": True,
        "return_token_ids": True,
        # the neutral values of what a search refuses are accepted (`vllm bench serve` sends one)
        "repetition_penalty": 1.0,
        "presence_penalty": 0,
        "min_tokens": 0,
        "logit_bias": {"5": 0},
    }
    status, r = call(server, "/v1/completions", body)
    assert status == 200, r
    assert [c["token_ids"] for c in r["choices"]] == [b.tokens[n_prompt:] for b in want.sequences]
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert r["choices"][0]["text"] == offline.get_tokenizer().decode(want.sequences[0].tokens[n_prompt:])
    assert all(c["finish_reason"] in ("stop", "length") for c in r["choices"])
    assert r["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in r["choices"])
    # a list of prompts: n choices each, in prompt order
    status, two = call(server, "/v1/completions", {**body, "prompt": [PROMPT, "Once upon a time"]})
    assert status == 200 and len(two["choices"]) == 6
    assert [c["token_ids"] for c in two["choices"][:3]] == [c["token_ids"] for c in r["choices"]]


FINISHED = "hybridserve_requests_finished_total"


def test_a_search_counts_its_choices_as_finished_requests(server: ServerProcess) -> None:
    """Each choice once, by its finish reason and sizes, as a sampled request's choices (its
    one-token queries are not requests of the client's)."""
    before = wait_idle(server)
    body = {"prompt": PROMPT, "n": 3, "max_tokens": 4, "use_beam_search": True, "return_token_ids": True}
    status, r = call(server, "/v1/completions", body)
    assert status == 200, r
    after = wait_idle(server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    reasons = [c["finish_reason"] for c in r["choices"]]
    for reason in ("stop", "length"):
        key = f'{FINISHED}{{finish_reason="{reason}"}}'
        assert delta(key) == reasons.count(reason), reason
    assert delta("hybridserve_request_generation_tokens_count") == 3
    assert delta("hybridserve_request_generation_tokens_sum") == r["usage"]["completion_tokens"]
    assert delta("hybridserve_request_prompt_tokens_sum") == 3 * r["usage"]["prompt_tokens"]
    assert delta("hybridserve_e2e_request_latency_seconds_count") == 3
    log_lines(
        server,
        r'hybridserve\.access: .*"POST /v1/completions" 200 prompt_tokens=\d+ output_tokens=\d+ .*ttft=\d',
    )


def test_a_streamed_search_sends_each_finished_beam_as_a_chunk(server: ServerProcess) -> None:
    """As vLLM streams a beam search (its beams are known only at the end): one chunk per choice
    with the whole text and finish reason, then the usage chunk; the same choices as unstreamed."""
    body = {"prompt": PROMPT, "n": 3, "max_tokens": 5, "use_beam_search": True, "return_token_ids": True}
    status, whole = call(server, "/v1/completions", body)
    assert status == 200, whole
    status, events = call(
        server, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert status == 200, events
    assert events[-1] == "[DONE]"
    chunks, last = events[:-2], events[-2]
    got = [c["choices"][0] for c in chunks]
    assert [(c["index"], c["text"], c["token_ids"], c["finish_reason"]) for c in got] == [
        (c["index"], c["text"], c["token_ids"], c["finish_reason"]) for c in whole["choices"]
    ]
    assert last["choices"] == [] and last["usage"] == whole["usage"]
    messages = [{"role": "user", "content": "Tell me about the city"}]
    with openai_client(server) as client:
        kw: dict[str, Any] = dict(model="demo", messages=messages, n=2, max_tokens=4)
        kw["extra_body"] = {"use_beam_search": True}
        plain = client.chat.completions.create(**kw)
        streamed = list(client.chat.completions.create(**kw, stream=True))
    by_index = {c.choices[0].index: c.choices[0] for c in streamed}
    assert [by_index[c.index].delta.content for c in plain.choices] == [
        c.message.content for c in plain.choices
    ]
    assert all(by_index[c.index].finish_reason == c.finish_reason for c in plain.choices)


def test_a_beam_that_ends_in_eos_shows_no_eos_text(server: ServerProcess, offline: LLM) -> None:
    """As in a sampled answer: the EOS is in token_ids but not in the text, even with special
    tokens shown."""
    prompt = "Hello world"  # (one of its three best beams ends in EOS after two tokens)
    (want,) = offline.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=5))
    eos = offline.engine.eos_token_id
    assert any(b.tokens[-1] == eos for b in want.sequences)
    body = {"prompt": prompt, "n": 3, "max_tokens": 5, "use_beam_search": True, "return_token_ids": True}
    status, r = call(server, "/v1/completions", {**body, "skip_special_tokens": False})
    assert status == 200, r
    ended = [c for c in r["choices"] if c["token_ids"][-1:] == [eos]]
    assert ended and all(c["finish_reason"] == "stop" for c in ended)
    tok = offline.get_tokenizer()
    for c in r["choices"]:
        shown = c["token_ids"][:-1] if c in ended else c["token_ids"]
        assert c["text"] == tok.decode(shown, skip_special_tokens=False)
    assert all(tok.decode([eos], skip_special_tokens=False) not in c["text"] for c in ended)
    assert r["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in r["choices"])


def test_chat_through_the_openai_client(server: ServerProcess, offline: LLM) -> None:
    messages = [{"role": "user", "content": "Tell me about the city"}]
    with openai_client(server) as client:
        r = client.chat.completions.create(
            model="demo",
            messages=messages,  # type: ignore[arg-type]
            n=2,
            max_tokens=4,
            extra_body={"use_beam_search": True, "length_penalty": 0.5},
        )
    prompt_ids = offline.get_tokenizer().encode(offline.engine.chat_template.render(messages, True))
    (want,) = offline.beam_search(
        {"prompt_token_ids": prompt_ids}, BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=0.5)
    )
    texts = [offline.get_tokenizer().decode(b.tokens[len(prompt_ids) :]) for b in want.sequences]
    assert [c.message.content for c in r.choices] == texts


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logprobs": 2}, "logprobs"),
        ({"stop": ["."]}, "stop"),
        ({"stop_token_ids": [5]}, "stop_token_ids"),
        ({"n": 11}, "n"),
        ({"echo": True}, "echo"),
        ({"length_penalty": "long"}, "length_penalty"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs"),
        # what would change the tokens allowed or their log-probabilities
        ({"allowed_token_ids": [5, 6]}, "allowed_token_ids"),
        ({"bad_words": ["the"]}, "bad_words"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"min_tokens": 2}, "min_tokens"),
        ({"repetition_penalty": 1.3}, "repetition_penalty"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -0.5}, "frequency_penalty"),
    ],
)
def test_what_a_beam_search_does_not_serve_is_a_400(
    server: ServerProcess, extra: dict[str, Any], param: str
) -> None:
    body = {"prompt": PROMPT, "n": 2, "max_tokens": 3, "use_beam_search": True, **extra}
    status, err = call(server, "/v1/completions", body)
    assert status == 400 and err["error"]["param"] == param, err


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "now"}}]}, "tools"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"bad_words": ["the"]}, "bad_words"),
    ],
)
def test_chat_refuses_so_too(server: ServerProcess, extra: dict[str, Any], param: str) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "n": 2, "max_tokens": 3, "use_beam_search": True}
    status, err = call(server, "/v1/chat/completions", {**body, **extra})
    assert status == 400 and err["error"]["param"] == param, err


# a search of 1600 steps: seconds of work (~1 s per 400 steps), still running when the test cuts
# it short however loaded the machine (the search stops at its next step)
LONG = {"prompt": PROMPT, "n": 3, "max_tokens": 1600, "ignore_eos": True, "use_beam_search": True}
GENERATED = "hybridserve_generation_tokens_total"


def _until_running(server: ServerProcess, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while held(get_metrics(server))["running"] == 0:
        assert time.monotonic() < deadline, "the search never ran"
        time.sleep(0.02)


def test_a_client_that_leaves_ends_its_search(server: ServerProcess) -> None:
    """The step's queries are aborted and no later step is sent: the engine is left idle having
    generated a fraction of the search's tokens."""
    before = wait_idle(server)[GENERATED]

    async def leave() -> None:
        writer = await post_and_hold(server, "/v1/completions", LONG)
        await asyncio.to_thread(_until_running, server)
        writer.close()
        await writer.wait_closed()

    aborted = f'{FINISHED}{{finish_reason="abort"}}'
    aborted_before = get_metrics(server).get(aborted, 0.0)
    asyncio.run(leave())
    idle = assert_idle(server)
    after = idle[GENERATED]
    assert 0 < after - before < LONG["n"] * LONG["max_tokens"] // 2, after - before
    assert idle[aborted] == aborted_before + LONG["n"]  # each choice it would have had ended "abort"
    # no choice was made: the access line has no time to a first token, as a cut sampled request's
    log_lines(
        server,
        r'hybridserve\.access: .*"POST /v1/completions" 499 prompt_tokens=\d+ output_tokens=0 .*ttft=- ',
    )
    status, out = call(server, "/v1/completions", {**LONG, "max_tokens": 3})  # (the server still serves)
    assert status == 200 and len(out["choices"]) == 3


def test_a_shutdown_ends_a_search_after_its_step() -> None:
    """SIGTERM during a search: it answers with its beams as they are, ending `abort`, and the
    server exits 0."""
    with running_server("--dtype", "float64", "--shutdown-timeout", "60") as srv:
        got: dict[str, Any] = {}
        ask = threading.Thread(target=lambda: got.update(answer=call(srv, "/v1/completions", LONG)))
        ask.start()
        _until_running(srv)
        srv.signal(signal.SIGTERM)
        ask.join(timeout=120)
        status, out = got["answer"]
        assert status == 200, out
        assert [c["finish_reason"] for c in out["choices"]] == ["abort"] * 3
        assert 0 < out["usage"]["completion_tokens"] < 3 * LONG["max_tokens"]
        # (the exit of the SIGTERM above, before the fixture's own stop could signal it again)
        assert srv.wait_exit(timeout=60) == 0, srv.output()[-3000:]


def test_nothing_is_left_held(server: ServerProcess) -> None:
    assert_idle(server)
