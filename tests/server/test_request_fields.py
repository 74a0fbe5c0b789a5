"""vLLM's request fields and the handling of unknown ones, in the parsers (server/protocol.py) without
an engine: add_special_tokens (observable with a tokenizer that adds a BOS), chat_template_kwargs
reaching the template, unknown fields refused (strict) or collected to be logged (the default of
the server), continuous usage stats only with include_usage; a served name that is a path (the
default: MODEL as given) has its model card."""

from __future__ import annotations

from typing import Any

import pytest
from tokenizers.processors import TemplateProcessing

from hybridserve.engine.chat_template import ChatTemplate, ContinuationError
from hybridserve.model.demo import ensure_demo_model
from hybridserve.server import protocol as P
from server_fixtures import TokenizerModelInfo

MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def bos_info() -> TokenizerModelInfo:
    """The demo tokenizer with a post-processor that adds BOS (id 0), as many models' do."""
    info = TokenizerModelInfo(ensure_demo_model(), max_model_len=256)
    info.tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    return info


def test_add_special_tokens_defaults_are_vllms(bos_info):
    plain = bos_info.encode("hello")
    assert plain[0] != 0
    completion = P.parse_completion_request({"prompt": "hello"}, bos_info, "demo")
    assert completion.prompts[0].token_ids == [0, *plain]  # completions: true by default
    off = P.parse_completion_request({"prompt": "hello", "add_special_tokens": False}, bos_info, "demo")
    assert off.prompts[0].token_ids == plain
    chat = P.parse_chat_request({"messages": MSGS}, bos_info, "demo")
    assert chat.prompts[0].token_ids == bos_info.encode_chat(MSGS, True)  # chat: false (the template's)
    with_bos = P.parse_chat_request({"messages": MSGS, "add_special_tokens": True}, bos_info, "demo")
    assert with_bos.prompts[0].token_ids == [0, *chat.prompts[0].token_ids]
    tok = P.parse_tokenize_request({"prompt": "hello"}, bos_info, "demo")
    assert tok.token_ids == completion.prompts[0].token_ids  # /tokenize counts what completions run
    tok_chat = P.parse_tokenize_request({"messages": MSGS}, bos_info, "demo")
    assert tok_chat.token_ids == chat.prompts[0].token_ids


def test_chat_template_kwargs_reach_the_template():
    class Info(TokenizerModelInfo):
        def __init__(self) -> None:
            super().__init__(ensure_demo_model())
            self.template = ChatTemplate(
                "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if think %} think{% endif %}"
            )

    info = Info()
    plain = P.parse_chat_request({"messages": MSGS}, info, "demo")
    thinking = P.parse_chat_request({"messages": MSGS, "chat_template_kwargs": {"think": True}}, info, "demo")
    assert info.tokenizer.decode(thinking.prompts[0].token_ids) == "hi think"
    assert info.tokenizer.decode(plain.prompts[0].token_ids) == "hi"
    for bad, code in (([1], "invalid_type"), ({"add_generation_prompt": False}, "invalid_value")):
        with pytest.raises(P.APIError) as e:
            P.parse_chat_request({"messages": MSGS, "chat_template_kwargs": bad}, info, "demo")
        assert (e.value.param, e.value.code) == ("chat_template_kwargs", code)


@pytest.mark.parametrize(
    "parse,body,names",
    [
        (
            P.parse_completion_request,
            {"prompt": "x", "frob": 1, "stream": True, "stream_options": {"include_usage": True, "x": 2}},
            ["frob", "stream_options.x"],
        ),
        (
            P.parse_chat_request,
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "x", "cache_control": {}}],
                        "reasoning_content": "",
                    }
                ],
                "top_a": 0.5,
            },
            ["top_a", "messages[0].reasoning_content", "messages[0].content[0].cache_control"],
        ),  # fmt: skip
        (P.parse_tokenize_request, {"prompt": "x", "truncate_prompt_tokens": 3}, ["truncate_prompt_tokens"]),
        (P.parse_detokenize_request, {"tokens": [1], "skip_special_tokens": True}, ["skip_special_tokens"]),
    ],
)
def test_unknown_fields_are_refused_when_strict_and_collected_otherwise(parse, body, names):
    info = TokenizerModelInfo(ensure_demo_model())
    with pytest.raises(P.APIError) as e:
        parse(body, info, "demo", strict=True)
    assert e.value.code == "unknown_field" and e.value.param in names
    assert sorted(parse(body, info, "demo", strict=False).ignored_fields) == sorted(names)


def test_continuous_usage_stats_only_with_include_usage():
    info = TokenizerModelInfo(ensure_demo_model())

    def continuous(opts: dict[str, Any]) -> bool:
        """Whether every chunk carries the usage (as the stream does: where usage is included)."""
        req = P.parse_completion_request(
            {"prompt": "x", "stream": True, "stream_options": opts}, info, "demo"
        )
        return req.include_usage and req.continuous_usage

    assert continuous({"include_usage": True, "continuous_usage_stats": True})
    assert not continuous({"continuous_usage_stats": True})  # (as vLLM)
    assert not continuous({"include_usage": True})
    with pytest.raises(P.APIError) as e:
        continuous({"continuous_usage_stats": "yes"})
    assert e.value.param == "stream_options.continuous_usage_stats"


async def test_a_served_name_that_is_a_path_has_its_model_card(aiohttp_client):
    from hybridserve.server.app import create_app

    name = "/models/nemotron-h/"
    client = await aiohttp_client(create_app(None, served_model_name=name, log_stats_interval_s=0))
    r = await client.get("/v1/models" + name)
    assert r.status == 200 and (await r.json())["id"] == name
    assert (await client.get("/v1/models/models/other")).status == 404
    demo = await aiohttp_client(create_app(None, served_model_name="demo", log_stats_interval_s=0))
    assert (await demo.get("/v1/models/demo")).status == 200
    assert (await demo.get("/v1/models/%2Fdemo")).status == 404


def test_tokenize_counts_the_tools_the_chat_route_renders():
    info = TokenizerModelInfo(ensure_demo_model(), max_model_len=4096)  # room for the tools block
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
            },
        }
    ]
    chat = P.parse_chat_request({"messages": MSGS, "tools": tools}, info, "demo")
    plain = P.parse_tokenize_request({"messages": MSGS}, info, "demo")
    tok = P.parse_tokenize_request({"messages": MSGS, "tools": tools}, info, "demo")
    assert tok.token_ids == chat.prompts[0].token_ids and len(tok.token_ids) > len(plain.token_ids)
    none = {"messages": MSGS, "tools": tools, "tool_choice": "none"}
    assert P.parse_tokenize_request(none, info, "demo").token_ids == plain.token_ids
    assert P.parse_chat_request(none, info, "demo").prompts[0].token_ids == plain.token_ids
    with pytest.raises(P.APIError) as e:
        P.parse_tokenize_request({"messages": MSGS, "tools": [{"type": "function"}]}, info, "demo")
    assert e.value.param is not None and e.value.param.startswith("tools")


def test_echo_offsets_index_the_clients_text_with_a_bos_the_tokenizer_adds() -> None:
    """The server's ModelInfo (app.EngineModelInfo) over a tokenizer that adds BOS: the BOS starts
    at 0, every token of the text where the texts before it end, a special token written in the
    text counted as written."""
    from types import SimpleNamespace

    from hybridserve.engine.tokenizer import Tokenizer
    from hybridserve.server.app import EngineModelInfo

    tok = Tokenizer(ensure_demo_model())
    tok._tok.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    info = EngineModelInfo(
        SimpleNamespace(
            tokenizer=tok,
            max_model_len=256,
            vocab_size=tok.vocab_size,
            max_logprobs=20,
            model_dir="",
            default_sampling={},
        ),  # type: ignore[arg-type]
        ChatTemplate("{{ messages[0]['content'] }}"),
    )
    text = "<|im_start|>hi naïve"
    req = P.parse_completion_request({"prompt": text, "echo": True, "logprobs": 1}, info, "demo")
    (prompt,) = req.prompts
    assert prompt.token_ids[0] == 0 and prompt.token_ids[1:] == tok.encode(text, add_special_tokens=False)
    starts = prompt.text_offsets
    assert starts is not None and len(starts) == len(prompt.token_ids) and starts[:3] == [0, 0, 12]
    for t, start in zip(prompt.token_ids[1:], starts[1:]):
        piece = tok.decode([t], skip_special_tokens=False)
        if "\ufffd" not in piece:  # (a piece of a character starts with the character)
            assert text[start:].startswith(piece), (piece, start)
    # without echo + logprobs nothing is computed
    assert (
        P.parse_completion_request({"prompt": text, "echo": True}, info, "demo").prompts[0].text_offsets
        is None
    )


def test_an_assistants_reasoning_sent_back_reaches_the_template():
    """An assistant message as the server answers it (`reasoning` and `reasoning_content`) is
    taken back, even by a strict server, and its reasoning reaches the template under both names,
    as vLLM and transformers hand it over (Qwen3's template renders it after the last query)."""

    class Info(TokenizerModelInfo):
        def __init__(self) -> None:
            super().__init__(ensure_demo_model())
            self.template = ChatTemplate(
                "{% for m in messages %}{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
                "|{{ m.reasoning }}</think>{% endif %}{{ m['content'] }};{% endfor %}"
            )

    info = Info()
    answer = {"role": "assistant", "content": "Blue.", "reasoning": "sky", "reasoning_content": "sky"}
    for sent in (answer, {"role": "assistant", "content": "Blue.", "reasoning": "sky"}):
        chat = P.parse_chat_request({"messages": [MSGS[0], sent]}, info, "demo")
        assert info.tokenizer.decode(chat.prompts[0].token_ids) == "hi;<think>sky|sky</think>Blue.;"
    with pytest.raises(P.APIError, match=r"messages\[1\]\.reasoning: must be a string"):
        P.parse_chat_request({"messages": [MSGS[0], {**answer, "reasoning": 5}]}, info, "demo")


ANSWER = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]


def test_a_continued_final_message_ends_the_prompt_inside_it():
    tpl = ChatTemplate()  # ChatML: every message ends with <|im_end|>
    full = tpl.render(ANSWER, add_generation_prompt=False)
    cut = tpl.render(ANSWER, add_generation_prompt=False, continue_final_message=True)
    assert cut == full[: full.rindex("<|im_end|>")] and cut.endswith("<|im_start|>assistant\nThe colour is")
    # the client's own trailing space stays where the template writes the content as given; a
    # template that trims the content takes it away, as transformers' apply_chat_template does
    spaced = [ANSWER[0], {"role": "assistant", "content": "The colour is "}]
    assert tpl.render(spaced, False, continue_final_message=True).endswith("The colour is ")
    trims = ChatTemplate("{% for m in messages %}[{{ m.role }}] {{ m.content | trim }}\n{% endfor %}")
    assert trims.render(spaced, False, continue_final_message=True) == (
        "[user] Name a colour.\n[assistant] The colour is"
    )
    # a message that also appears inside the template's own text ("i" of "<|im_end|>") is cut at its
    # own end, not at the last copy of it
    short = [ANSWER[0], {"role": "assistant", "content": "i"}]
    assert tpl.render(short, False, continue_final_message=True).endswith("<|im_start|>assistant\ni")


@pytest.mark.parametrize(
    "template, messages, add_generation_prompt, wanted",
    [
        (None, [ANSWER[0], {"role": "assistant", "content": ""}], False, "no content"),
        ("{% for m in messages %}{{ m.content | upper }}{% endfor %}", ANSWER, False, "as given"),
        ("{% for m in messages %}{{ m.content }}{{ m.content }}{% endfor %}", ANSWER, False, "as given"),
        (None, ANSWER, True, "generation prompt"),
    ],
)
def test_a_final_message_that_cannot_be_continued_is_refused(
    template, messages, add_generation_prompt, wanted
):
    with pytest.raises(ContinuationError, match=wanted):
        ChatTemplate(template).render(messages, add_generation_prompt, continue_final_message=True)


def test_continue_final_message_through_the_chat_route_and_tokenize(bos_info):
    body = {"messages": ANSWER, "continue_final_message": True}
    chat = P.parse_chat_request(body, bos_info, "demo")
    text = bos_info.template.render(ANSWER, False, continue_final_message=True)
    assert chat.prompts[0].token_ids == bos_info.encode(text)  # add_generation_prompt false by default
    assert P.parse_tokenize_request(body, bos_info, "demo").token_ids == chat.prompts[0].token_ids
    plain = P.parse_chat_request({"messages": ANSWER}, bos_info, "demo")
    assert plain.prompts[0].token_ids != chat.prompts[0].token_ids
    for bad in (
        {**body, "add_generation_prompt": True},
        {**body, "messages": [*ANSWER[:1], {"role": "assistant", "content": None}]},
        {**body, "continue_final_message": "yes"},
    ):
        for parse in (P.parse_chat_request, P.parse_tokenize_request):
            with pytest.raises(P.APIError) as e:
                parse(bad, bos_info, "demo")
            assert e.value.param == "continue_final_message" and e.value.status == 400, (bad, e.value)


def test_allowed_token_ids_and_bad_words_reach_the_sampling_params(bos_info):
    body = {"prompt": "hello", "allowed_token_ids": [5, 9], "bad_words": ["no", " never"]}
    p = P.parse_completion_request(body, bos_info, "demo").params
    assert p.allowed_token_ids == [5, 9] and p.bad_words == ["no", " never"]
    chat = P.parse_chat_request({"messages": MSGS, "bad_words": ["x"]}, bos_info, "demo").params
    assert chat.bad_words == ["x"] and chat.allowed_token_ids is None
    vocab = bos_info.vocab_size
    for bad, code in (
        ({"allowed_token_ids": []}, "invalid_value"),
        ({"allowed_token_ids": [vocab]}, "invalid_value"),
        ({"allowed_token_ids": "5"}, "invalid_type"),
        ({"bad_words": "no"}, "invalid_type"),
        ({"bad_words": [1]}, "invalid_type"),
        ({"bad_words": ["\t"]}, "invalid_value"),
        ({"bad_words": ["a\ud800"]}, "invalid_value"),
    ):
        field = next(iter(bad))
        with pytest.raises(P.APIError) as e:
            P.parse_completion_request({"prompt": "hello", **bad}, bos_info, "demo")
        assert (e.value.param, e.value.code, e.value.status) == (field, code, 400), (bad, e.value)


def test_truncate_prompt_tokens_keeps_the_last_tokens(bos_info):
    long_text = "one two three four five six seven eight nine ten " * 60
    ids = bos_info.encode(long_text, add_special_tokens=True)
    assert len(ids) > bos_info.max_model_len
    with pytest.raises(P.APIError) as e:  # whole, it cannot fit
        P.parse_completion_request({"prompt": long_text}, bos_info, "demo")
    assert e.value.code == "context_length_exceeded"
    cut = P.parse_completion_request({"prompt": long_text, "truncate_prompt_tokens": 100}, bos_info, "demo")
    assert cut.prompts[0].token_ids == ids[-100:] and cut.prompts[0].text is None
    assert cut.params.max_tokens is not None and cut.params.max_tokens > 0
    short = P.parse_completion_request({"prompt": "hello", "truncate_prompt_tokens": 100}, bos_info, "demo")
    assert short.prompts[0].token_ids == bos_info.encode("hello", True) and short.prompts[0].text == "hello"
    lists = P.parse_completion_request(
        {"prompt": [[5, 6, 7], [8]], "truncate_prompt_tokens": 2}, bos_info, "demo"
    )
    assert [p.token_ids for p in lists.prompts] == [[6, 7], [8]]
    # -1: the context length, which leaves no room to generate
    with pytest.raises(P.APIError) as e:
        P.parse_completion_request({"prompt": long_text, "truncate_prompt_tokens": -1}, bos_info, "demo")
    assert e.value.param == "prompt"
    messages = [{"role": "user", "content": long_text}]
    chat = P.parse_chat_request({"messages": messages, "truncate_prompt_tokens": 50}, bos_info, "demo")
    assert chat.prompts[0].token_ids == bos_info.encode_chat(messages, True)[-50:]
    for bad in (0, -2, bos_info.max_model_len + 1, "5"):
        with pytest.raises(P.APIError) as e:
            P.parse_completion_request({"prompt": "x", "truncate_prompt_tokens": bad}, bos_info, "demo")
        assert e.value.param == "truncate_prompt_tokens", bad
