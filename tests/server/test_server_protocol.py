"""Server protocol without an engine: strict parsing into SamplingParams, response shapes, metrics
registry, and the app's behaviour before a model is attached (health 503, auth, error bodies)."""

from __future__ import annotations

import json
import math

import pytest

import hybridserve
from hybridserve.engine.chat_template import ChatTemplate
from hybridserve.model.demo import ensure_demo_model
from hybridserve.sampling.logprobs import Logprob
from hybridserve.sampling.params import MAX_STOP_STR_LEN, MAX_STOP_STRS_TOTAL_LEN
from hybridserve.sampling.seeds import choice_seed
from hybridserve.server import protocol as P
from hybridserve.server.app import create_app
from hybridserve.server.metrics import ENGINE_COUNTERS, ENGINE_GAUGES, ServerMetrics
from hybridserve.server.sse import encode_event
from server_fixtures import TokenizerModelInfo, parse_metrics, parse_sse

MODEL = "demo"


@pytest.fixture(scope="module")
def info() -> TokenizerModelInfo:
    return TokenizerModelInfo(ensure_demo_model(), max_model_len=64)


def completion(info, **body):
    return P.parse_completion_request(body, info, MODEL)


def chat(info, **body):
    return P.parse_chat_request(body, info, MODEL)


def expect_error(fn, param=None, status=400, code=None) -> P.APIError:
    with pytest.raises(P.APIError) as ei:
        fn()
    err = ei.value
    assert err.status == status, (err.status, err.message)
    if param is not None:
        assert err.param == param, (err.param, err.message)
    if code is not None:
        assert err.code == code, (err.code, err.message)
    body = err.body()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return err


# ------------------------------------------------------------------------- body decoding


def test_decode_json_body_accepts_an_object():
    assert P.decode_json_body(b'{"a": [1, 2.5, "\\u00e9"]}') == {"a": [1, 2.5, "é"]}


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"[1, 2]", b'"str"', b"\xff\xfe{}", b'{"prompt": "\xc3\x28"}', b'{"x": NaN}', b'{"x": -Infinity}',
     b"[" * 100_000 + b"]" * 100_000, b'{"n": 1' + b"0" * 5000 + b"}"],
)  # fmt: skip
def test_decode_json_body_rejects(raw):
    expect_error(lambda: P.decode_json_body(raw), code="invalid_json")


# ------------------------------------------------------------------------- completions


def test_completion_defaults(info):
    req = completion(info, model=MODEL, prompt="Hello world")
    assert req.kind == "completion"
    assert req.prompts[0].token_ids == info.encode("Hello world")
    assert req.prompts[0].text == "Hello world"
    p = req.params
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.logprobs, p.stop) == (1, 16, 1.0, 1.0, None, [])
    assert not req.stream and not req.include_usage and req.cache_salt is None


def test_completion_all_fields(info):
    req = completion(
        info, model=MODEL, prompt=[5, 6, 7], max_tokens=9, temperature=0, top_p=0.5, top_k=3, min_p=0.1, seed=7,
        stop=["x", "yz"], n=3, stream=True, stream_options={"include_usage": True}, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.2, ignore_eos=True, min_tokens=2, logprobs=2, user="u",
        cache_salt="tenant-a", stop_token_ids=[2], best_of=3, logit_bias=None, echo=False,
    )  # fmt: skip
    p = req.params
    assert req.prompts[0].token_ids == [5, 6, 7] and req.prompts[0].text is None
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (9, 0.0, 0.5, 3, 0.1, 7)
    assert (p.n, p.ignore_eos, p.min_tokens, p.logprobs, p.stop_token_ids) == (3, True, 2, 2, [2])
    assert p.stop == ["x", "yz"] and p.repetition_penalty == 1.2
    assert req.stream and req.include_usage and req.cache_salt == "tenant-a" and req.logprobs == 2
    # one engine request per choice, n = 1 each, distinct seeds
    subs = [req.choice_params(i) for i in range(3)]
    assert [s.n for s in subs] == [1, 1, 1]
    assert [s.seed for s in subs] == [7, choice_seed(7, 1), choice_seed(7, 2)]
    assert len({7, choice_seed(7, 1), choice_seed(7, 2), choice_seed(8, 1)}) == 4
    assert all(s.max_tokens == 9 and s.temperature == 0.0 for s in subs)


def test_completion_prompt_batch_and_stop_string(info):
    req = completion(info, prompt=["a b", "c d e"], stop="\n", n=2, max_tokens=4)
    assert [p.text for p in req.prompts] == ["a b", "c d e"]
    assert req.num_sequences == 4 and req.params.stop == ["\n"]
    req = completion(info, prompt=[[1, 2], [3]], max_tokens=4)
    assert [p.token_ids for p in req.prompts] == [[1, 2], [3]]


def test_a_list_of_text_prompts_is_encoded_in_one_call():
    """The engine's tokenizer encodes a list long in all without holding Python's global lock,
    which it can only do when it gets the whole list at once (engine/tokenizer.py)."""
    calls: list[list[str]] = []

    class Counting(TokenizerModelInfo):
        def encode(self, text, add_special_tokens=False):
            raise AssertionError("a text prompt went through encode")

        def encode_many(self, texts, add_special_tokens=False):
            calls.append(list(texts))
            return [list(self.tokenizer.encode(t, add_special_tokens=add_special_tokens).ids) for t in texts]

    counting = Counting(ensure_demo_model(), max_model_len=64)
    req = completion(counting, prompt=["a b", "c d e", "f"], max_tokens=4)
    assert calls == [["a b", "c d e", "f"]]
    want = [list(counting.tokenizer.encode(t, add_special_tokens=True).ids) for t in ("a b", "c d e", "f")]
    assert [p.token_ids for p in req.prompts] == want


def test_completion_max_tokens_default_and_context(info):
    ids = list(range(3, 13))  # 10 tokens, max_model_len 64
    assert completion(info, prompt=ids, max_tokens=54).params.max_tokens == 54
    expect_error(
        lambda: completion(info, prompt=ids, max_tokens=55), "max_tokens", code="context_length_exceeded"
    )
    expect_error(
        lambda: completion(info, prompt=list(range(64)), max_tokens=1),
        "prompt",
        code="context_length_exceeded",
    )
    # without max_tokens: OpenAI's 16, or the room the longest prompt leaves
    assert completion(info, prompt=ids).params.max_tokens == 16
    assert completion(info, prompt=list(range(3, 63))).params.max_tokens == 4
    # several prompts: each its own default within the room it leaves, choice by choice
    both = completion(info, prompt=[ids, list(range(3, 63))], n=2)
    assert [both.choice_params(i).max_tokens for i in range(4)] == [16, 16, 4, 4]
    assert completion(info, prompt=[ids, list(range(3, 63))], max_tokens=4).choice_params(0).max_tokens == 4
    assert chat(info, messages=[{"role": "user", "content": "hi"}]).params.max_tokens == 64 - len(
        info.encode_chat([{"role": "user", "content": "hi"}], True)
    )


BAD_COMPLETIONS = [
    ({"prompt": "x", "bogus": 1}, "bogus"),
    ({}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": 42}, "prompt"),
    ({"prompt": ["a", 1]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [1, 2.0]}, "prompt"),
    ({"prompt": [True]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [10**6]}, "prompt"),
    ({"prompt": [10**40]}, "prompt"),
    ({"prompt": "\ud800"}, "prompt"),
    ({"prompt": ["x"] * 65}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -5}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**30}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "16"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 16.5}, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "temperature": -0.1}, "temperature"),
    ({"prompt": "x", "temperature": 1e308}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": 10**400}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "min_p": 2}, "min_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 129}, "n"),
    ({"prompt": "x", "n": 10**20}, "n"),
    ({"prompt": ["a", "b"], "n": 65}, "n"),
    ({"prompt": "x", "seed": -(2**63) - 1}, "seed"),
    ({"prompt": "x", "seed": 2**64}, "seed"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop": ["a", None]}, "stop"),
    ({"prompt": "x", "stop": {"a": 1}}, "stop"),
    ({"prompt": "x", "stop": ["s"] * 17}, "stop"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": "2"}, "stop_token_ids"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ({"prompt": "x", "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
    ({"prompt": "x", "stream": 1}, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "stream": True, "stream_options": {"bogus": True}}, "stream_options.bogus"),
    ({"prompt": "x", "stream": True, "stream_options": [1]}, "stream_options"),
    ({"prompt": "x", "cache_salt": ""}, "cache_salt"),
    ({"prompt": "x", "cache_salt": 5}, "cache_salt"),
    ({"prompt": "x", "user": 5}, "user"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "x", "suffix": "tail"}, "suffix"),
    ({"prompt": "x", "best_of": 4}, "best_of"),
    ({"prompt": "x", "max_tokens": 0, "logprobs": 1}, "max_tokens"),  # 0 only to score (echo)
    ({"prompt": "x", "return_token_ids": 1}, "return_token_ids"),
    ({"prompt": "x", "return_token_ids": "true"}, "return_token_ids"),
    ({"prompt": "x", "return_token_ids": [True]}, "return_token_ids"),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS)
def test_completion_rejects(info, body, param):
    expect_error(lambda: completion(info, **body), param)


def test_stop_string_length_limits(info):
    # the limits of sampling/params.py, shared with the offline API; at the limits is fine
    at_limit = [chr(97 + i) * MAX_STOP_STR_LEN for i in range(P.MAX_STOP_SEQUENCES)]
    assert sum(map(len, at_limit)) <= MAX_STOP_STRS_TOTAL_LEN
    assert completion(info, prompt="x", stop=at_limit).params.stop == at_limit
    assert chat(info, messages=[{"role": "user", "content": "x"}], stop=at_limit).params.stop == at_limit
    too_long = "s" * (MAX_STOP_STR_LEN + 1)
    for parse in (
        lambda: completion(info, prompt="x", stop=too_long),
        lambda: completion(info, prompt="x", stop=["a", too_long]),
        lambda: chat(info, messages=[{"role": "user", "content": "x"}], stop=[too_long]),
    ):
        err = expect_error(parse, "stop", code="invalid_value")
        assert f"at most {MAX_STOP_STR_LEN} characters" in err.message, err.message


@pytest.mark.parametrize(
    "name,values,rng",
    [
        ("top_p", (0, -1, 1.1), "(0, 1]"),
        ("repetition_penalty", (0, 11), "(0, 10]"),
        ("temperature", (-1, 3), "[0, 2]"),
        ("min_p", (-0.5, 2), "[0, 1]"),
    ],
)
def test_range_errors_name_one_range_per_parameter(info, name, values, rng):
    for v in values:
        err = expect_error(lambda v=v: completion(info, prompt="x", **{name: v}), name)
        assert f"must be in {rng}" in err.message, err.message
    assert getattr(completion(info, prompt="x", **{name: 1}).params, name) == 1


def test_completion_wrong_model_is_404(info):
    expect_error(
        lambda: completion(info, model="gpt-4", prompt="x"), "model", status=404, code="model_not_found"
    )


def test_return_token_ids_is_a_bool_defaulting_to_false(info):
    assert completion(info, prompt="x").return_token_ids is False
    assert completion(info, prompt="x", return_token_ids=None).return_token_ids is False
    assert completion(info, prompt="x", return_token_ids=True).return_token_ids is True
    msgs = [{"role": "user", "content": "x"}]
    assert chat(info, messages=msgs).return_token_ids is False
    assert chat(info, messages=msgs, return_token_ids=True).return_token_ids is True
    err = expect_error(lambda: completion(info, prompt="x", return_token_ids=1), "return_token_ids")
    assert err.code == "invalid_type" and "must be a boolean" in err.message


# ------------------------------------------------------------------------- chat


def test_chat_renders_the_model_template(info):
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]},
    ]
    req = chat(info, model=MODEL, messages=msgs, max_completion_tokens=5, logprobs=True, top_logprobs=2)
    expected = (  # (text parts a part per line, as vLLM joins them)
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi\nthere<|im_end|>\n<|im_start|>assistant\n"
    )
    assert req.prompts[0].token_ids == info.encode(expected)
    assert req.params.max_tokens == 5 and req.params.logprobs == 2 and req.logprobs == 2
    assert chat(info, messages=msgs, logprobs=True).params.logprobs == 0
    assert chat(info, messages=msgs).params.logprobs is None
    # the Responses forms of a text part and an assistant's refusal are text too, as vLLM reads them
    typed = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "hi"}, {"type": "text", "text": "there"}],
        },
        {
            "role": "assistant",
            "content": [{"type": "output_text", "text": "no"}, {"type": "refusal", "refusal": "I won't"}],
        },
        {"role": "user", "content": "why"},
    ]
    plain = [
        *typed[:2],
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "no"}, {"type": "text", "text": "I won't"}],
        },
        typed[3],
    ]
    assert chat(info, messages=typed).prompts[0].token_ids == chat(info, messages=plain).prompts[0].token_ids
    expect_error(
        lambda: chat(info, messages=[{"role": "user", "content": [{"type": "refusal", "refusal": 5}]}]),
        "messages[0].content[0].refusal",
    )


BAD_CHATS = [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0].extra"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0].type",
    ),
    ({"messages": [{"role": "user", "content": "\udfff"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    (
        {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
        "response_format.type",
    ),
    (
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "max_completion_tokens": 6},
        "max_completion_tokens",
    ),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x" * 400}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt": "x"}, "prompt"),
    ({"messages": [{"role": "user", "content": "x"}], "return_token_ids": 0}, "return_token_ids"),
]


@pytest.mark.parametrize("body,param", BAD_CHATS)
def test_chat_rejects(info, body, param):
    expect_error(lambda: chat(info, **body), param)


def test_chat_template_raise_exception_is_a_400(info):
    strict = ChatTemplate("{{ raise_exception('only user messages') }}")

    class Strict(TokenizerModelInfo):
        def encode_chat(self, messages, add_generation_prompt, **kwargs):
            return self.encode(strict.render(messages, add_generation_prompt))

    s = Strict(ensure_demo_model())
    err = expect_error(lambda: chat(s, messages=[{"role": "user", "content": "x"}]), "messages")
    assert "only user messages" in err.message


# ------------------------------------------------------------------------- response shapes


def test_token_id_fields_are_vllms_and_only_there_when_asked_for():
    plain = P.completion_choice(0, "t", "length", None)
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
    c = P.completion_choice(1, "t", "stop", None, "x", prompt_token_ids=(5, 6), token_ids=[7])
    assert (c["prompt_token_ids"], c["token_ids"]) == ([5, 6], [7])
    # chat: the prompt's ids go on the response (and on the chunk), the output ids on the choice
    ch = P.chat_choice(0, "t", "length", None, token_ids=[7, 8])
    assert ch["token_ids"] == [7, 8] and "prompt_token_ids" not in ch
    resp = P.chat_response("id", 0, MODEL, [ch], P.usage_dict(2, 2, 0), prompt_token_ids=[5, 6])
    assert resp["prompt_token_ids"] == [5, 6]
    assert "prompt_token_ids" not in P.chat_response("id", 0, MODEL, [], P.usage_dict(2, 0, 0))
    chunk = P.chat_chunk("id", 0, MODEL, [P.chat_chunk_choice(0, content="t", token_ids=[7])],
                         prompt_token_ids=[5])  # fmt: skip
    assert chunk["prompt_token_ids"] == [5] and chunk["choices"][0]["token_ids"] == [7]
    assert "token_ids" not in P.chat_chunk_choice(0, content="t")


def test_logprob_shapes():
    entries = [
        {5: Logprob(-0.5, 1, "a"), 6: Logprob(-1.5, 2, "b")},
        {7: Logprob(-2.0, 3, "cc"), 5: Logprob(-0.1, 1, "a"), 8: Logprob(float("-inf"), 9, "z")},
    ]
    c = P.completion_logprobs(entries, [5, 7], lambda t: f"<{t}>", P.TextOffsets(3))
    assert c == {
        "tokens": ["a", "cc"],
        "token_logprobs": [-0.5, -2.0],
        "top_logprobs": [{"a": -0.5, "b": -1.5}, {"a": -0.1, "cc": -2.0, "z": -9999.0}],
        "text_offset": [3, 4],
    }
    json.dumps(c, allow_nan=False)
    ch = P.chat_logprobs(entries, [5, 7], lambda t: "", top_n=1)
    assert [x["token"] for x in ch["content"]] == ["a", "cc"]
    assert ch["content"][1]["logprob"] == -2.0 and ch["content"][1]["bytes"] == [99, 99]
    assert ch["content"][1]["top_logprobs"] == [{"token": "a", "logprob": -0.1, "bytes": [97]}]
    assert P.usage_dict(5, 3, 2) == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


def test_text_offsets_count_characters_across_deltas():
    # "é" = c3 a9 split over two tokens (and two stream deltas), then a lone continuation byte
    # (an invalid sequence: one replacement character), then "x"
    o = P.TextOffsets(2)
    first = [o.advance(b"a"), o.advance(b"\xc3")]
    second = [o.advance(b"\xa9"), o.advance(b"\xb2"), o.advance(b"x"), o.advance(b"")]
    assert first + second == [2, 3, 3, 4, 5, 6]
    assert o.offset == 6  # a, é, U+FFFD, x after the start offset 2
    # an unfinished character cut off by a token that does not continue it: one U+FFFD, then " cat"
    o = P.TextOffsets()
    assert [o.advance(b) for b in (b"\xf0", b"\x9f", b" c", b"at")] == [0, 0, 1, 3]
    assert o.offset == len("\ufffd cat")


def test_sse_event_framing():
    raw = encode_event({"text": "a\nb", "é": 1}) + b"data: [DONE]\n\n"
    assert parse_sse(raw) == [{"text": "a\nb", "é": 1}, "[DONE]"]


def test_metrics_registry_is_per_app_and_complete():
    stats = {k: i + 1 for i, k in enumerate([*ENGINE_GAUGES, *ENGINE_COUNTERS])}
    m1, m2 = ServerMetrics(lambda: stats), ServerMetrics(lambda: None)
    m1.time_to_first_token.observe(0.2)
    v1, v2 = parse_metrics(m1.render().decode()), parse_metrics(m2.render().decode())
    for key, (name, _) in ENGINE_GAUGES.items():
        assert v1[name] == stats[key] and v2[name] == 0
    for key, (name, _) in ENGINE_COUNTERS.items():
        assert v1[name + "_total"] == stats[key] and v2[name + "_total"] == 0
    assert v1["hybridserve_time_to_first_token_seconds_count"] == 1
    assert v2["hybridserve_time_to_first_token_seconds_count"] == 0
    assert "hybridserve_inter_token_latency_seconds_count" in v1
    assert not math.isnan(v1["hybridserve_time_to_first_token_seconds_sum"])
    # the scheduler's own key names are read when the contract's are absent
    m3 = ServerMetrics(lambda: {"num_running": 3, "num_waiting": 2, "prefix_hit_tokens": 48})
    v3 = parse_metrics(m3.render().decode())
    assert v3["hybridserve_num_requests_running"] == 3 and v3["hybridserve_num_requests_waiting"] == 2
    assert v3["hybridserve_prefix_cache_hit_tokens_total"] == 48


def test_long_latencies_fall_in_buckets_up_to_vllm_s_tops():
    """A first token after 10 minutes and a request of an hour land in buckets of their own (as in
    vLLM's histograms), not in +Inf, where every quantile would read as the last bucket."""
    m = ServerMetrics(lambda: None, "demo")
    m.time_to_first_token.observe(600.0)
    m.e2e_latency.observe(3600.0)
    v = parse_metrics(m.render().decode())
    ttft = 'vllm:time_to_first_token_seconds_bucket{le="%s",model_name="demo"}'
    e2e = 'vllm:e2e_request_latency_seconds_bucket{le="%s",model_name="demo"}'
    assert v[ttft % "160.0"] == 0 and v[ttft % "640.0"] == 1 and v[ttft % "2560.0"] == 1
    assert v[e2e % "1920.0"] == 0 and v[e2e % "7680.0"] == 1


def test_finished_request_series_exist_at_zero_from_the_start():
    """As vLLM's: rate() and increase() count from a series' first sample, so one that appears
    only with its first request (at 1) would lose that request."""
    v = parse_metrics(ServerMetrics(lambda: None, "demo").render().decode())
    for reason in ("stop", "length", "abort"):
        assert v[f'vllm:request_success_total{{finished_reason="{reason}",model_name="demo"}}'] == 0
    for reason in ("stop", "length", "abort", "error"):
        assert v[f'hybridserve_requests_finished_total{{finish_reason="{reason}"}}'] == 0


# ------------------------------------------------------------------------- app without a model


async def test_app_before_the_model_is_loaded(aiohttp_client):
    client = await aiohttp_client(create_app(None, served_model_name=MODEL, api_key="k3y"))
    r = await client.get("/health")
    assert r.status == 503 and (await r.json())["status"] == "loading"
    # vLLM's other liveness routes answer as /health, without the key; /version at once
    for method in (client.get, client.post):
        r = await method("/ping")
        assert r.status == 503 and (await r.json())["status"] == "loading"
    r = await client.get("/version")
    assert r.status == 200 and (await r.json()) == {"version": hybridserve.__version__}
    r = await client.get("/metrics")  # the liveness routes' 503s are answers, not errors
    assert 'hybridserve_http_errors_total{status="503"}' not in await r.text()
    auth = {"Authorization": "Bearer k3y"}
    r = await client.post("/v1/completions", json={"prompt": "x"}, headers=auth)
    assert r.status == 503 and r.headers["Retry-After"]
    assert (await r.json())["error"]["code"] == "model_loading"
    r = await client.post("/v1/completions", json={"prompt": "x"})
    assert r.status == 401
    body = await r.json()
    assert (
        set(body["error"]) == {"message", "type", "param", "code"}
        and body["error"]["code"] == "invalid_api_key"
    )
    r = await client.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer nope"})
    assert r.status == 401
    r = await client.get("/v1/models", headers=auth)
    assert r.status == 200 and (await r.json())["data"][0]["id"] == MODEL
    r = await client.get("/nowhere")
    assert r.status == 404 and (await r.json())["error"]["type"] == "not_found_error"
    r = await client.get("/v1/completions", headers=auth)
    assert r.status == 405 and "message" in (await r.json())["error"]
    r = await client.get("/metrics")
    assert r.status == 200
    values = parse_metrics(await r.text())
    assert values["hybridserve_model_ready"] == 0 and values["hybridserve_num_requests_running"] == 0


# ------------------------------------------------------------------------- tool-call history

CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
]


def test_tool_call_history_is_accepted_and_parsed():
    msgs = P._parse_messages(HISTORY)
    assert msgs[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    }
    assert msgs[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    # arguments that are not JSON stay text; "type" may be left out; an empty list is no calls
    odd = {"id": "c", "function": {"name": "f", "arguments": "not json"}}
    msgs = P._parse_messages(
        [{"role": "assistant", "tool_calls": [odd]}, {"role": "assistant", "content": "x", "tool_calls": []}]
    )
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == "not json"
    assert "tool_calls" not in msgs[1]
    # empty arguments: {} (as vLLM)
    (msg,) = P._parse_messages(
        [{"role": "assistant", "tool_calls": [{**odd, "function": {"name": "f", "arguments": ""}}]}]
    )
    assert msg["tool_calls"][0]["function"]["arguments"] == {}
    # nested deeper than the JSON parser goes: text too, not a server error
    deep = "[" * 100_000 + "]" * 100_000
    (msg,) = P._parse_messages(
        [{"role": "assistant", "tool_calls": [{**odd, "function": {"name": "f", "arguments": deep}}]}]
    )
    assert msg["tool_calls"][0]["function"]["arguments"] == deep


def test_tool_call_history_renders_as_hermes_text_for_chatml(info):
    """The demo template knows neither tool_calls nor the tool role: Hermes text, the result in a
    user turn."""
    rendered = P._render_tool_history(
        P._served_template(info), P._parse_messages(HISTORY), P._tool_parser(info), tools=False
    )
    assert rendered[1] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    }
    assert rendered[2] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    ids, _ = P._render_chat({"messages": HISTORY}, info, P.UnknownFields(strict=True))
    text = info.tokenizer.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>tool" not in text and "<tool_response>" in text and "<tool_call>" in text


def test_tool_call_history_goes_to_templates_that_render_it(info):
    tpl = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'tool' %}[result {{ m.tool_call_id }}: {{ m.content }}]"
        "{% elif m.tool_calls %}{% for c in m.tool_calls %}[call {{ c.function.name }} "
        "{{ c.function.arguments | tojson }}]{% endfor %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
    )

    class Aware(TokenizerModelInfo):
        chat_template = tpl

        def encode_chat(self, messages, add_generation_prompt, **kwargs):
            self.seen = messages
            return self.encode(tpl.render(messages, add_generation_prompt))

    a = Aware(ensure_demo_model())
    chat(a, messages=HISTORY, max_tokens=1)
    assert a.seen[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert a.seen[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def _with(i, **fields):
    msgs = [dict(m) for m in HISTORY]
    msgs[i] = {**msgs[i], **fields}
    return msgs


def _call(**fn):
    return {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}", **fn}}


BAD_TOOL_HISTORY = [
    (
        _with(1, tool_calls=[{"type": "function", "function": {"name": "f", "arguments": "{}"}}]),
        "messages[1].tool_calls[0].id",
    ),
    (_with(1, tool_calls=[{"id": "c", "type": "function"}]), "messages[1].tool_calls[0].function"),
    (
        _with(1, tool_calls=[{"id": "c", "function": {"arguments": "{}"}}]),
        "messages[1].tool_calls[0].function.name",
    ),
    (
        _with(1, tool_calls=[_call(arguments={"city": "Paris"})]),
        "messages[1].tool_calls[0].function.arguments",
    ),
    (_with(1, tool_calls=[_call(arguments=None)]), "messages[1].tool_calls[0].function.arguments"),
    (_with(1, tool_calls=[{**_call(), "type": "code"}]), "messages[1].tool_calls[0].type"),
    (_with(1, tool_calls=[{**_call(), "extra": 1}]), "messages[1].tool_calls[0].extra"),
    (_with(1, tool_calls={"id": "c"}), "messages[1].tool_calls"),
    (_with(1, tool_calls=["c"]), "messages[1].tool_calls[0]"),
    (_with(0, tool_calls=[_call()]), "messages[0].tool_calls"),
    ([HISTORY[0], HISTORY[1], {"role": "tool", "content": "sunny"}], "messages[2].tool_call_id"),
    (_with(2, tool_call_id=5), "messages[2].tool_call_id"),
    # escapes in the arguments' JSON text that decode to a lone surrogate (no tokenizer encodes it)
    (
        _with(1, tool_calls=[_call(arguments='{"city": "\\ud800"}')]),
        "messages[1].tool_calls[0].function.arguments",
    ),
]


@pytest.mark.parametrize("messages,param", BAD_TOOL_HISTORY)
def test_malformed_tool_history_is_a_400_naming_the_field(info, messages, param):
    expect_error(lambda: chat(info, messages=messages), param)
