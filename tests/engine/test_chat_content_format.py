"""How a chat template is handed a message's content (vLLM's --chat-template-content-format): a
template that loops over a message's content gets a list of text parts, the parts the client
sent, and renders as transformers' `apply_chat_template` renders those messages; any other
template gets the parts joined one per line. `LLM.chat`, the server's chat route and its
/tokenize take the same path."""

from __future__ import annotations

import pickle
from functools import cache
from typing import Any

import pytest

from hybridserve import LLM, ConfigError, EngineArgs, SamplingParams
from hybridserve.engine.chat_template import ChatTemplate, TextParts, detect_content_format
from server_fixtures import call, running_server

# Loops over a message's content where it is a list, as Gemma 3's template does; each part is
# trimmed and written without a separator, so a list renders unlike its joined string.
LOOPING = (
    "{% for message in messages %}<{{ message['role'] }}>"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}[{{ part['text'] | trim }}]{% endfor %}{% endif %}"
    "</{{ message['role'] }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
PLAIN = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}"
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You bake."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "How long "}, {"type": "text", "text": " does it bake?"}],
    },
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "t", "arguments": "{}"}}],
    },
    {"role": "user", "content": "And the bread?"},
]
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.mark.parametrize(
    ("template", "want"),
    [
        (LOOPING, "openai"),
        (PLAIN, "string"),
        # through a variable set from the messages, and from that one
        (
            "{% set rest = messages[1:] %}{% set turns = rest %}"
            "{% for m in turns %}{% for c in m.content %}{{ c.text }}{% endfor %}{% endfor %}",
            "openai",
        ),
        # a filtered content, and one set to a variable first
        (
            "{% for m in messages %}{% for c in m['content'] | list %}{{ c }}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% for m in messages %}{% set content = m.content %}{% if content is string %}{{ content }}"
            "{% else %}{% for c in content %}{{ c.text }}{% endfor %}{% endif %}{% endfor %}",
            "openai",
        ),
        # a macro handed a message's content (Qwen3-VL's `render_content`)
        (
            "{% macro render(content) %}{% for item in content %}{{ item.text }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ render(m.content) }}{% endfor %}",
            "openai",
        ),
        # a filter's result is no message
        (
            "{% for m in messages %}{% for c in (m | tojson).content %}{{ c }}{% endfor %}{% endfor %}",
            "string",
        ),
        # a loop over something else's content is not a message's
        (
            "{% for c in tool.content %}{{ c }}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}",
            "string",
        ),
        ("{% for c in messages[0]['content'] %}{{ c }}{% endfor %}", "string"),
        ("{% for m in messages %}{{ m.content", "string"),  # (a template that does not parse)
    ],
)
def test_auto_detects_a_loop_over_a_message_s_content(template: str, want: str) -> None:
    assert detect_content_format(template) == want


def _as_transformers_takes_them(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as vLLM hands them to a template taking a list: each content a list of text
    parts (an absent content none), without None-valued keys."""
    out = []
    for m in messages:
        content = m.get("content")
        if content is None:
            content = []
        elif isinstance(content, str):
            content = [{"type": "text", "text": content}]
        out.append({**{k: v for k, v in m.items() if v is not None}, "content": content})
    return out


@cache
def llm() -> LLM:
    return LLM("demo", dtype="float32", max_model_len=512, max_num_seqs=4)


def test_a_looping_template_renders_the_parts_as_transformers_does() -> None:
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(llm().engine.model_dir)
    want = auto.apply_chat_template(
        _as_transformers_takes_them(CONVERSATION),
        chat_template=LOOPING,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert "[How long][does it bake?]" in want and "<assistant></assistant>" in want
    (out,) = llm().chat(CONVERSATION, GREEDY, chat_template=LOOPING)
    assert out.prompt == want
    # "string" joins the parts one per line, as for a template that takes strings
    (joined,) = llm().chat(CONVERSATION, GREEDY, chat_template=LOOPING, chat_template_content_format="string")
    assert "<user>How long \n does it bake?</user>" in joined.prompt
    # "openai" hands a plain template lists, as vLLM does (it writes their text)
    (listed,) = llm().chat(CONVERSATION, GREEDY, chat_template=PLAIN, chat_template_content_format="openai")
    assert "<system>[{'type': 'text', 'text': 'You bake.'}]</system>" in listed.prompt
    (plain,) = llm().chat(CONVERSATION, GREEDY, chat_template=PLAIN)
    assert (
        "<user>How long \n does it bake?</user>" in plain.prompt and "<assistant></assistant>" in plain.prompt
    )


def test_a_continued_message_of_parts_ends_after_its_last_part() -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Once"}, {"type": "text", "text": "upon a"}],
        },
    ]
    template = ChatTemplate(LOOPING)
    want = "<user>[Hi]</user>\n<assistant>[Once][upon a"  # (a string content is one part)
    assert (
        template.render(
            [messages[0], {**messages[1], "content": TextParts(["Once", "upon a"])}],
            False,
            continue_final_message=True,
        )
        == want
    )
    (out,) = llm().chat(
        messages, GREEDY, chat_template=LOOPING, add_generation_prompt=False, continue_final_message=True
    )
    assert out.prompt == want


def test_text_parts_are_their_joined_string_everywhere_else() -> None:
    t = TextParts(["a", "b"])
    assert t == "a\nb" and t.parts == ("a", "b") and f"{t}!" == "a\nb!"
    back = pickle.loads(pickle.dumps(t))
    assert isinstance(back, TextParts) and back.parts == ("a", "b")


def test_the_flag_is_checked() -> None:
    with pytest.raises(ConfigError, match="--chat-template-content-format: one of auto, string, openai"):
        EngineArgs(model="demo", chat_template_content_format="list").validate()


def test_the_server_hands_the_parts_to_a_looping_template() -> None:
    """--chat-template-content-format and the chat route's parsing: /tokenize of a conversation
    with parts gives the ids of transformers' rendering (and "string" those of the joined text)."""
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(llm().engine.model_dir)
    # (without the tool call: the server writes calls into the content of a template that does
    # not render them, which transformers does not)
    conversation = [{k: v for k, v in m.items() if k != "tool_calls"} for m in CONVERSATION]
    body = {"messages": conversation, "add_generation_prompt": True}
    expected = {
        "auto": auto.apply_chat_template(
            _as_transformers_takes_them(conversation),
            chat_template=LOOPING,
            tokenize=True,
            add_generation_prompt=True,
        ),
        "string": auto.apply_chat_template(
            [
                {**m, "content": "How long \n does it bake?"} if i == 1 else m
                for i, m in enumerate(conversation)
            ],
            chat_template=LOOPING,
            tokenize=True,
            add_generation_prompt=True,
        ),
    }
    # the model's template (here a request's own, which keeps the served format) or --chat-template
    for fmt, flags, extra in (
        ("auto", ["--chat-template", LOOPING], {}),
        (
            "string",
            ["--trust-request-chat-template", "--chat-template-content-format", "string"],
            {"chat_template": LOOPING},
        ),
    ):
        with running_server(*flags) as server:
            status, out = call(server, "/tokenize", {**body, **extra})
            assert status == 200, out
            want = expected[fmt]
            assert out["tokens"] == list(getattr(want, "input_ids", want)), fmt
