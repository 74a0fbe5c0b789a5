"""Chat template rendering from the model's tokenizer_config.json (jinja2, sandboxed, HF semantics).

As transformers' `apply_chat_template` renders: the variables `messages`, `tools` and `documents`
(None when not given), `add_generation_prompt` and every special token's text (`bos_token`,
`eos_token`, `pad_token`, ...); its `tojson` filter, `raise_exception`, `strftime_now` and its
`{% generation %}` block (which only marks the assistant's text: rendered as it is); messages
without their None-valued keys, reasoning also as `reasoning_content` and `thinking`. A model with
named templates (a list in tokenizer_config.json, or `additional_chat_templates/NAME.jinja`)
renders `tool_use` when the conversation has tools, else `default`; a request may name one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridserve.config.args import CHAT_CONTENT_FORMATS, chat_template_source
from hybridserve.engine.tokenizer import with_special_tokens_map
from hybridserve.errors import ConfigError

if TYPE_CHECKING:
    from hybridserve.engine.tokenizer import Tokenizer

# Used when the model ships no chat template: ChatML, as most hybrid instruct models use.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TemplateError(Exception):
    """The template called raise_exception (it rejects these messages)."""


class ContinuationError(ValueError):
    """The final message cannot be continued: it has no content, or the template does not write
    its content as given."""


# A message's text content parts become one string, a part per line, as vLLM joins them for a
# template that takes string content: parts written as separate paragraphs stay apart.
TEXT_PART_SEPARATOR = "\n"


# The content parts that are text, and the key that holds it: the Responses forms and an
# assistant's refusal are text too, as vLLM reads them (clients send a conversation back with them)
TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


class TextParts(str):
    """A message's content given as text parts: the parts joined one per line (the string every
    check and rewrite reads), and the parts themselves, which a template taking "openai" content
    is handed. A rewritten content (a plain `str` made from it) is one part."""

    parts: tuple[str, ...]

    def __new__(cls, parts: Sequence[str]) -> TextParts:
        out = super().__new__(cls, TEXT_PART_SEPARATOR.join(parts))
        out.parts = tuple(parts)
        return out

    def __reduce__(self) -> tuple[Any, ...]:
        return (TextParts, (self.parts,))


def _unwrapped(node: Any) -> Any:
    """A value with its filters, tests and slices taken off (`messages[1:]`, `x | trim`)."""
    from jinja2 import nodes

    while True:
        if isinstance(node, nodes.Filter | nodes.Test) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            return node


def _names_one_of(node: Any, names: set[str]) -> bool:
    from jinja2 import nodes

    node = _unwrapped(node)
    return isinstance(node, nodes.Name) and node.name in names


def _content_of_one_of(node: Any, names: set[str]) -> bool:
    """Whether `node` is `m.content` or `m['content']` (filtered, sliced) of a variable `m` in
    `names`."""
    from jinja2 import nodes

    node = _unwrapped(node)
    if isinstance(node, nodes.Getattr) and node.attr == "content":
        inner = node.node
    elif (
        isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    ):
        inner = node.node
    else:
        return False
    return isinstance(inner, nodes.Name) and inner.name in names


def detect_content_format(source: str) -> str:
    """ "openai" when the template loops over a message's content, else "string", as vLLM's
    "auto" tells them apart: a loop over `message['content']` (or `.content`; the message a loop
    variable over `messages` or over a variable set from it), over a variable set from a
    message's content, or over a variable named `content` (a macro's parameter that is handed a
    message's content: `{% macro render(content) %}{% for item in content %}`)."""
    from jinja2 import Environment, TemplateSyntaxError, nodes

    try:
        tree = Environment(extensions=["jinja2.ext.loopcontrols", _generation_extension()]).parse(source)
    except TemplateSyntaxError:
        return "string"
    lists = {"messages"}
    assigns = [
        (a.target.name, a.node) for a in tree.find_all(nodes.Assign) if isinstance(a.target, nodes.Name)
    ]
    while True:  # the variables set from it, and from those (`{% set loop_messages = messages[1:] %}`)
        more = {name for name, value in assigns if _names_one_of(value, lists)} - lists
        if not more:
            break
        lists |= more
    loops = list(tree.find_all(nodes.For))
    messages = {
        f.target.name for f in loops if isinstance(f.target, nodes.Name) and _names_one_of(f.iter, lists)
    }
    # (`{% set content = message['content'] %}` ... `{% for part in content %}`)
    contents = {"content"} | {name for name, value in assigns if _content_of_one_of(value, messages)}
    looped = any(_content_of_one_of(f.iter, messages) or _names_one_of(f.iter, contents) for f in loops)
    return "openai" if looped else "string"


# Appended to the final message's content to find where the template writes that content's end:
# searching the rendered text for the content itself would match a copy of it elsewhere (a short
# message such as "i" inside the template's own end-of-turn text). It ends with a space, as
# transformers' tag does: a template that trims the content trims that too, and then the content's
# own trailing spaces went with it (the text is cut before the mark and stripped at its end).
_CONTINUE_MARK = "HYBRIDSERVE-CONTINUE-5c0e7a91 "
# The special tokens transformers passes to a template by their names
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


# The names a message's reasoning is given under: a template reads the first (Qwen3's); gpt-oss's
# read `thinking`. transformers fills them from one another (`_alias_reasoning_fields`).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _template_messages(messages: list[dict[str, Any]], openai_content: bool) -> list[dict[str, Any]]:
    """The messages as transformers' `apply_chat_template` hands them to a template: without the
    keys whose value is None (the OpenAI SDK's messages carry `tool_calls: None`, `name: None`,
    ...: a template that asks `'tool_calls' in message` would then iterate None), and with a
    message's reasoning under another of its names (`reasoning`, `thinking`) as
    `reasoning_content` and `thinking` too, the names templates read. With `openai_content`,
    each content is a list of text parts, as vLLM hands content to such a template: the parts
    given (none for an assistant's absent content), or the string as one part."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        content = m.get("content")
        if isinstance(content, str):
            if not openai_content:
                m["content"] = str(content)
            else:
                texts = content.parts if isinstance(content, TextParts) else (content,)
                m["content"] = [{"type": "text", "text": t} for t in texts]
        out.append(m)
    return out


def _token_text(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    content = v.get("content") if isinstance(v, dict) else None
    return content if isinstance(content, str) else None


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # (transformers' filter: no HTML escaping, its options)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _generation_extension() -> Any:
    """transformers' `{% generation %}...{% endgeneration %}` block: it marks the assistant's
    text for training masks; rendering it renders its body."""
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return Generation


class ChatTemplate:
    def __init__(
        self,
        template: str | None = None,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        special_tokens: dict[str, str] | None = None,
        named: dict[str, str] | None = None,
        content_format: str = "auto",
    ) -> None:
        """`special_tokens`: the texts of the tokenizer's special tokens by name (`bos_token` and
        `eos_token` win over theirs); `named`: the model's other named templates (`tool_use`);
        `content_format`: one of CHAT_CONTENT_FORMATS."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if content_format not in CHAT_CONTENT_FORMATS:
            raise ValueError(
                f"content format: one of {', '.join(CHAT_CONTENT_FORMATS)}, got {content_format!r}"
            )
        self.content_format = content_format
        self._detected: dict[str, bool] = {}  # source -> whether its content is "openai"

        self.source = template or DEFAULT_CHAT_TEMPLATE
        self.special_tokens = {
            **(special_tokens or {}),
            **({"bos_token": bos_token} if bos_token is not None else {}),
            **({"eos_token": eos_token} if eos_token is not None else {}),
        }
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.named = dict(named or {})

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def strftime_now(fmt: str) -> str:
            return datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols", _generation_extension()],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        self._env = env
        self._template = env.from_string(self.source)
        self._compiled_named: dict[str, Any] = {}

    def with_source(self, template: str) -> ChatTemplate:
        """Another template's text with this one's special tokens (a request's or --chat-template);
        a name among the model's named templates is that template. The template given is the one
        rendered, tools or not (as transformers renders a template it is given)."""
        source = self.named.get(template, template)
        return ChatTemplate(source, special_tokens=self.special_tokens, content_format=self.content_format)

    def with_content_format(self, content_format: str) -> ChatTemplate:
        """This template handing content over as `content_format` says (one of CHAT_CONTENT_FORMATS)."""
        if content_format == self.content_format:
            return self
        return ChatTemplate(
            self.source, special_tokens=self.special_tokens, named=self.named, content_format=content_format
        )

    def openai_content(self, tools: bool) -> bool:
        """Whether the template a conversation renders with is handed content as a list of parts."""
        if self.content_format != "auto":
            return self.content_format == "openai"
        source = self.source_for(tools)
        if source not in self._detected:
            self._detected[source] = detect_content_format(source) == "openai"
        return self._detected[source]

    def source_for(self, tools: bool) -> str:
        """The text of the template a conversation renders with: the model's `tool_use` one when
        it has tools and the model names one, else the template's own."""
        return self.named.get("tool_use", self.source) if tools else self.source

    def _for(self, extra: dict[str, Any] | None) -> Any:
        """The template to render: the model's `tool_use` one when the conversation has tools."""
        # (given tools, even none, as transformers picks the template: `tools is not None`)
        source = self.named.get("tool_use") if extra and extra.get("tools") is not None else None
        if source is None:
            return self._template
        if "tool_use" not in self._compiled_named:
            self._compiled_named["tool_use"] = self._env.from_string(source)
        return self._compiled_named["tool_use"]

    @classmethod
    def served(
        cls, model_dir: str | Path | None, override: str | None = None, content_format: str = "auto"
    ) -> ChatTemplate:
        """The template an engine serves: `override` (a `--chat-template` value: a file holding a
        template, or the template itself) with the model's BOS and EOS texts, else the model's;
        handing content over as `content_format` says (--chat-template-content-format)."""
        model = cls.from_model_dir(model_dir).with_content_format(content_format)
        if override is None:
            return model
        return model.with_source(chat_template_source(override))

    @classmethod
    def from_model_dir(cls, model_dir: str | Path | None) -> ChatTemplate:
        """The template of `model_dir/chat_template.jinja`, else tokenizer_config.json's, else
        ChatML; the special tokens of tokenizer_config.json and special_tokens_map.json."""
        if model_dir is None:
            return cls()
        d = Path(model_dir)
        cfg: dict[str, Any] = {}
        cfg_path = d / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                cfg = {}
        try:
            cfg = with_special_tokens_map(d, cfg)
        except ConfigError:
            pass  # (the tokenizer refuses it, naming the file)
        template = cfg.get("chat_template")
        named: dict[str, str] = {}
        if isinstance(template, list):  # named templates: "default" is the template
            named = {
                t["name"]: t["template"]
                for t in template
                if isinstance(t, dict)
                and isinstance(t.get("name"), str)
                and isinstance(t.get("template"), str)
            }
            template = named.get("default") or next(iter(named.values()), None)
        jinja_path = d / "chat_template.jinja"
        if jinja_path.is_file():  # (a template file of its own wins over the config's, as in transformers)
            template = jinja_path.read_text(encoding="utf-8")
        extra_dir = d / "additional_chat_templates"  # (transformers 5 saves named ones there)
        if extra_dir.is_dir():
            for f in sorted(extra_dir.glob("*.jinja")):
                named.setdefault(f.stem, f.read_text(encoding="utf-8"))
        tokens = {
            name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(cfg.get(name))) is not None
        }
        return cls(template if isinstance(template, str) else None, special_tokens=tokens, named=named)

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        extra: dict[str, Any] | None = None,
        *,
        continue_final_message: bool = False,
    ) -> str:
        """`extra`: more template variables (a request's `chat_template_kwargs`, e.g. a model's
        `enable_thinking`); the ones set here win over them. `continue_final_message`: the text
        ends right after the final message's content, with no end of turn, so that the model
        continues that message (with `add_generation_prompt` false; raises ContinuationError)."""
        if not continue_final_message:
            return self._render(messages, add_generation_prompt, extra)
        if add_generation_prompt:
            raise ContinuationError("a continued final message takes no generation prompt after it")
        content = messages[-1].get("content") if messages else None
        if not isinstance(content, str) or not content:
            raise ContinuationError("the final message has no content to continue")
        # (content given as parts: the mark ends the last part)
        parts = content.parts if isinstance(content, TextParts) else (content,)
        marked_content = TextParts([*parts[:-1], parts[-1] + _CONTINUE_MARK])
        marked = [*messages[:-1], {**messages[-1], "content": marked_content}]
        text = self._render(marked, False, extra)
        mark = _CONTINUE_MARK.strip()
        if text.count(mark) != 1:
            raise ContinuationError(
                "the chat template does not write the final message's content as given, so it cannot be continued"
            )
        at = text.index(mark)
        if text.startswith(_CONTINUE_MARK, at):
            return text[:at]
        return text[:at].rstrip()  # (the template trims the content: its own trailing space too)

    def _render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, extra: dict[str, Any] | None
    ) -> str:
        return str(
            self._for(extra).render(
                {
                    "tools": None,
                    "documents": None,
                    **(extra or {}),
                    # (the server's: a request's template variables do not replace them)
                    **{name: "" for name in ("bos_token", "eos_token")},
                    **self.special_tokens,
                    "messages": _template_messages(
                        messages, self.openai_content(extra is not None and extra.get("tools") is not None)
                    ),
                    "add_generation_prompt": add_generation_prompt,
                }
            )
        )


def encode_rendered(tokenizer: Tokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
    """The ids of a rendered conversation. The template usually writes the BOS text itself, so a
    second BOS that the tokenizer adds in front of it is dropped."""
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    bos = tokenizer.bos_token_id
    if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    return ids
