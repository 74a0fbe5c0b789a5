"""`LLM.chat` (vLLM's offline chat API) and `--chat-template` / `EngineArgs.chat_template`, on the
demo model: the prompt is the chat template's rendering as transformers makes it, a template given
replaces the model's everywhere the engine renders (and the shared-prefix markers follow it), and
bad conversations or templates are refused with typed errors that leave the engine serving."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from hybridserve import LLM, ConfigError, EngineArgs, InvalidRequestError, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
CONVERSATION = [
    {"role": "system", "content": "You are a helpful baker."},
    {"role": "user", "content": "How long does the cake bake?"},
    {"role": "assistant", "content": "About 35 minutes."},
    {"role": "user", "content": "And the bread?"},
]
# A template that writes no special token between messages (so it declares no shared prefix) and
# reads a template variable.
PLAIN = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}{{ greeting | default('assistant') }}:{% endif %}"
)


@cache
def llm32() -> LLM:
    return LLM("demo", dtype="float32", max_model_len=512, max_num_seqs=8)


def test_chat_prompt_is_the_model_template_as_transformers_renders_it() -> None:
    from transformers import AutoTokenizer

    llm = llm32()
    auto = AutoTokenizer.from_pretrained(llm.engine.model_dir)
    want_text = auto.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    want_ids = auto(want_text, add_special_tokens=False).input_ids
    out = llm.chat(CONVERSATION, GREEDY)
    assert out[0].prompt == want_text
    assert out[0].prompt_token_ids == want_ids
    # the reply is generate's for the same ids
    same = llm.generate({"prompt_token_ids": want_ids}, GREEDY)
    assert out[0].outputs[0].token_ids == same[0].outputs[0].token_ids
    assert len(out[0].outputs[0].token_ids) == 8


def test_many_conversations_text_parts_and_per_conversation_params() -> None:
    llm = llm32()
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "How long does"}, {"type": "text", "text": "it bake?"}],
        }
    ]
    plain = [{"role": "user", "content": "How long does\nit bake?"}]  # (a part per line, as vLLM)
    longer = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = llm.chat([parts, plain, CONVERSATION], [GREEDY, GREEDY, longer])
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8, 12]
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert outs[2].outputs[0].token_ids[:8] == llm.chat(CONVERSATION, GREEDY)[0].outputs[0].token_ids
    # the Responses forms and a refusal are text parts too, as the server and vLLM read them
    typed = [
        {"role": "user", "content": [{"type": "input_text", "text": "How long does"}]},
        {
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hm"}, {"type": "refusal", "refusal": "no"}],
        },
        {"role": "user", "content": "it bake?"},
    ]
    same = [typed[0], {"role": "assistant", "content": "Hm\nno"}, typed[2]]
    assert llm.chat(typed, GREEDY)[0].prompt_token_ids == llm.chat(same, GREEDY)[0].prompt_token_ids


def test_a_message_without_content_renders_as_empty() -> None:
    """None content (an assistant turn with only tool calls) renders as an empty message, as the
    server renders it, rather than failing inside a template that adds strings."""
    llm = llm32()
    out = llm.chat([*CONVERSATION[:2], {"role": "assistant", "content": None}, CONVERSATION[3]], GREEDY)
    assert "<|im_start|>assistant\n<|im_end|>" in out[0].prompt


def test_continue_final_message_and_generation_prompt() -> None:
    llm = llm32()
    started = [*CONVERSATION, {"role": "assistant", "content": "The bread takes"}]
    out = llm.chat(started, GREEDY, add_generation_prompt=False, continue_final_message=True)
    assert out[0].prompt.endswith("<|im_start|>assistant\nThe bread takes")
    no_prompt = llm.chat(CONVERSATION, GREEDY, add_generation_prompt=False)
    assert no_prompt[0].prompt.endswith("And the bread?<|im_end|>\n")
    with pytest.raises(InvalidRequestError, match="generation prompt"):
        llm.chat(started, GREEDY, continue_final_message=True)  # add_generation_prompt defaults to true


def test_chat_template_argument_and_template_variables() -> None:
    llm = llm32()
    out = llm.chat(CONVERSATION[:2], GREEDY, chat_template=PLAIN, chat_template_kwargs={"greeting": "baker"})
    want = "system: You are a helpful baker.\n\nuser: How long does the cake bake?\n\nbaker:"
    assert out[0].prompt == want
    assert out[0].prompt_token_ids == llm.get_tokenizer().encode(want)
    # the engine's own template is unchanged by a call's template
    assert llm.chat(CONVERSATION[:2], GREEDY)[0].prompt.startswith("<|im_start|>system\n")


def test_tools_reach_the_template_as_transformers_passes_them() -> None:
    """`tools` are the template's `tools` variable, as `apply_chat_template(tools=...)` renders
    them; something other than a list of tools is refused."""
    from transformers import AutoTokenizer

    llm = llm32()
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_time",
                "description": "The time in a zone",
                "parameters": {"type": "object", "properties": {"zone": {"type": "integer"}}},
            },
        }
    ]
    template = (
        "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }}: "
        "{{ t['function']['description'] }} {{ t | tojson }}{% endfor %}</tools>\n{% endif %}" + PLAIN
    )
    out = llm.chat(CONVERSATION[:2], GREEDY, chat_template=template, tools=tools)
    auto = AutoTokenizer.from_pretrained(llm.engine.model_dir)
    want = auto.apply_chat_template(
        CONVERSATION[:2], tools=tools, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert out[0].prompt == want and "get_time: The time in a zone" in want
    assert "<tools>" not in llm.chat(CONVERSATION[:2], GREEDY, chat_template=template)[0].prompt
    for bad in ({"type": "function"}, "get_time", [1], 5, (t for t in tools)):
        with pytest.raises(InvalidRequestError, match="tools"):
            llm.chat(CONVERSATION[:2], GREEDY, tools=bad)  # type: ignore[arg-type]


def test_earlier_tool_calls_reach_the_template_with_their_arguments_parsed() -> None:
    """An earlier call's `arguments` (JSON text in OpenAI's shape) reach the template as the
    object they hold, as vLLM's `LLM.chat` and the server hand them over: a template that writes
    them with `tojson` wrote the text again, quoted, and one that walks their items refused."""
    llm = llm32()
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": 2}'}}
    messages = [
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "noon"},
    ]
    template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
        "{% for c in m.get('tool_calls', []) %}{{ c['function']['arguments'] | tojson }}"
        "{% for k, v in c['function']['arguments'] | items %}[{{ k }}={{ v }}]{% endfor %}{% endfor %}\n"
        "{% endfor %}"
    )
    prompt = llm.chat(messages, GREEDY, chat_template=template)[0].prompt
    assert 'assistant: {"zone": 2}[zone=2]' in prompt
    assert call["function"]["arguments"] == '{"zone": 2}'  # (the caller's message is left as it is)
    # none, or empty: {} (as vLLM)
    for empty in ("", None):
        messages[1]["tool_calls"] = [{**call, "function": {"name": "get_time", "arguments": empty}}]
        assert "assistant: {}tool" in llm.chat(messages, GREEDY, chat_template=template)[0].prompt


def test_engine_chat_template_file_is_served_and_sets_the_shared_prefix_markers(tmp_path: Path) -> None:
    path = tmp_path / "plain.jinja"
    path.write_text(PLAIN, encoding="utf-8")
    llm = LLM("demo", dtype="float32", max_model_len=512, max_num_seqs=8, chat_template=str(path))
    try:
        out = llm.chat(CONVERSATION[:2], GREEDY)
        assert (
            out[0].prompt
            == "system: You are a helpful baker.\n\nuser: How long does the cake bake?\n\nassistant:"
        )
        # the model's ChatML ends a message with <|im_end|>, which the auto markers take; this
        # template writes nothing special between messages, so it declares no shared prefix
        assert llm.engine.shared_prefix_markers == ()
        assert llm32().engine.shared_prefix_markers == (llm.get_tokenizer().encode("<|im_end|>")[0],)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hello", "messages: a non-empty list"),
        ([], "messages: a non-empty list"),
        ([{"role": "user", "content": "hi"}, "hi"], r"messages\[1\]: a message is a mapping"),
        ([{"content": "hi"}], r"messages\[0\]\.role"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\.content: a string"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            r"content\[0\]: only text parts",
        ),
        ([[{"role": "user", "content": "hi"}], []], r"messages\[1\]: a non-empty list"),
    ],
)
def test_malformed_conversations_are_refused(messages: object, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        llm32().chat(messages, GREEDY)  # type: ignore[arg-type]


def test_template_refusals_are_typed_and_leave_the_engine_serving() -> None:
    llm = llm32()
    refusing = "{{ raise_exception('only user messages') }}"
    with pytest.raises(InvalidRequestError, match="only user messages"):
        llm.chat(CONVERSATION, GREEDY, chat_template=refusing)
    with pytest.raises(InvalidRequestError, match="chat_template"):
        llm.chat(CONVERSATION, GREEDY, chat_template="{% for m in messages %}")
    with pytest.raises(InvalidRequestError, match="chat_template: a Jinja template's text"):
        llm.chat(CONVERSATION, GREEDY, chat_template="")
    # a template that fails on these messages (a number where it adds strings) is refused too
    adding = "{% for m in messages %}{{ 'x' + m['extra'] }}{% endfor %}"
    with pytest.raises(InvalidRequestError, match="refused"):
        llm.chat([{"role": "user", "content": "hi", "extra": 5}], GREEDY, chat_template=adding)
    with pytest.raises(InvalidRequestError, match="chat_template_kwargs"):
        llm.chat(CONVERSATION, GREEDY, chat_template_kwargs=["greeting"])  # type: ignore[arg-type]
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.chat(CONVERSATION, GREEDY)[0].outputs[0].token_ids) == 8


def test_bad_chat_template_setting_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--chat-template: .*neither a file nor a Jinja template"):
        EngineArgs(model="demo", chat_template=str(tmp_path / "missing.jinja")).validate()
    with pytest.raises(ConfigError, match="--chat-template: "):
        EngineArgs(model="demo", chat_template="{% if %}").validate()
    bad = tmp_path / "bad.jinja"
    bad.write_text("{{ messages[0] ", encoding="utf-8")
    with pytest.raises(ConfigError, match="--chat-template: "):
        EngineArgs(model="demo", chat_template=str(bad)).validate()
    with pytest.raises(ConfigError, match="--chat-template must be"):
        EngineArgs(model="demo", chat_template="").validate()


NAMED_DEFAULT = (
    "{% if tools is not none %}TOOLS {% endif %}{% if documents is not none %}DOCS {% endif %}"
    "{{ pad_token }}{% for m in messages %}{% generation %}{{ m['content'] | trim }}{% endgeneration %}"
    "{{ {'b': 1, 'a': m['role']} | tojson(sort_keys=True, separators=(',', ':')) }}{% endfor %}"
)
NAMED_TOOL_USE = "TOOL-USE {{ tools | length if tools else 0 }} {% for m in messages %}{{ m['content'] | trim }}{% endfor %}"


def test_named_templates_and_the_template_environment_are_transformers(tmp_path: Path) -> None:
    """A model with named templates renders `tool_use` when tools are given and `default` else; a
    template sees `tools` and `documents` as None when not given, every special token's text
    (`pad_token`), transformers' `tojson` options and its `{% generation %}` block; a trimmed
    continued message loses its trailing space, as transformers cuts it."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from hybridserve.engine.chat_template import ChatTemplate
    from hybridserve.model.demo import resolve_model_path

    shutil.copy(Path(resolve_model_path("demo")) / "tokenizer.json", tmp_path / "tokenizer.json")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": [
            {"name": "default", "template": NAMED_DEFAULT},
            {"name": "tool_use", "template": NAMED_TOOL_USE},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    auto = AutoTokenizer.from_pretrained(tmp_path)
    ours = ChatTemplate.from_model_dir(tmp_path)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    chat = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "The answer is "}]
    for kw in ({}, {"tools": tools}):
        want = auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **kw)
        assert ours.render(chat, True, dict(kw)) == want
    want = auto.apply_chat_template(chat, tokenize=False, continue_final_message=True)
    assert ours.render(chat, False, continue_final_message=True) == want
    assert want.endswith("The answer is")
    # a request (or LLM.chat) may name one of the model's templates, or give its own: that one is
    # rendered, tools or not, as transformers renders a template it is given
    assert ours.with_source("tool_use").render(chat, True).startswith("TOOL-USE 0 ")  # (tools: None)
    for given in ("default", "OWN {{ tools | length }}"):
        want = auto.apply_chat_template(chat, tokenize=False, chat_template=given, tools=tools)
        assert ours.with_source(given).render(chat, True, {"tools": tools}) == want
    # the server decides how to write tools and calls from the template that renders them
    from hybridserve.server.protocol import _template_renders_tools

    plain = {**config, "chat_template": [{"name": "default", "template": "{{ messages | length }}"},
                                          {"name": "tool_use", "template": NAMED_TOOL_USE}]}  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(plain))
    assert _template_renders_tools(ChatTemplate.from_model_dir(tmp_path))


def test_messages_reach_the_template_as_transformers_hands_them_over(tmp_path: Path) -> None:
    """As `apply_chat_template`: keys whose value is None are left out (the OpenAI SDK's messages
    carry `tool_calls: None`; Llama 3.1's template asks `'tool_calls' in message`), reasoning given
    as `reasoning` or `thinking` is `reasoning_content` too (Qwen3's template reads that), and
    tools given, even none, pick the model's `tool_use` template."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from hybridserve.engine.chat_template import ChatTemplate
    from hybridserve.engine.llm import _conversations
    from hybridserve.model.demo import resolve_model_path

    template = (
        "{% for m in messages %}{{ m.role }}{% if 'name' in m %}({{ m.name }}){% endif %}: "
        "{% if 'tool_calls' in m %}{{ m.tool_calls | length }} calls {% endif %}"
        "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}|{{ m.thinking }}</think>{% endif %}"
        "{{ m.content }}\n{% endfor %}"
    )
    shutil.copy(Path(resolve_model_path("demo")) / "tokenizer.json", tmp_path / "tokenizer.json")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "chat_template": [
            {"name": "default", "template": template},
            {"name": "tool_use", "template": "TOOL-USE"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    auto = AutoTokenizer.from_pretrained(tmp_path)
    ours = ChatTemplate.from_model_dir(tmp_path)
    chat = [
        {"role": "user", "content": "Hi", "name": None},
        {
            "role": "assistant",
            "content": "Hello",
            "tool_calls": None,
            "function_call": None,
            "reasoning": "r1",
        },
        {"role": "user", "content": "More", "name": "ann"},
        {"role": "assistant", "content": "Sure", "thinking": "t2"},
    ]
    want = auto.apply_chat_template(chat, tokenize=False)
    assert ours.render(_conversations(chat)[0], False) == want
    assert "assistant: <think>r1|r1</think>Hello\n" in want and "calls" not in want
    want = auto.apply_chat_template(chat, tools=[], tokenize=False)
    assert ours.render(_conversations(chat)[0], False, {"tools": []}) == want == "TOOL-USE"
