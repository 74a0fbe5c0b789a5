"""Chat template rendering from the model's tokenizer_config.json (jinja2, sandboxed, HF semantics)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridserve.config.args import chat_template_source

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


# Appended to the final message's content to find where the template writes that content's end:
# searching the rendered text for the content itself would match a copy of it elsewhere (a short
# message such as "i" inside the template's own end-of-turn text).
_CONTINUE_MARK = "HYBRIDSERVE-CONTINUE-5c0e7a91"


def _token_text(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    content = v.get("content") if isinstance(v, dict) else None
    return content if isinstance(content, str) else None


class ChatTemplate:
    def __init__(
        self, template: str | None = None, *, bos_token: str | None = None, eos_token: str | None = None
    ) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.source = template or DEFAULT_CHAT_TEMPLATE
        self.bos_token = bos_token
        self.eos_token = eos_token

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def strftime_now(fmt: str) -> str:
            return datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii
        )
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        self._template = env.from_string(self.source)

    @classmethod
    def served(cls, model_dir: str | Path | None, override: str | None = None) -> ChatTemplate:
        """The template an engine serves: `override` (a `--chat-template` value: a file holding a
        template, or the template itself) with the model's BOS and EOS texts, else the model's."""
        model = cls.from_model_dir(model_dir)
        if override is None:
            return model
        return cls(chat_template_source(override), bos_token=model.bos_token, eos_token=model.eos_token)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path | None) -> ChatTemplate:
        """The template of `model_dir/tokenizer_config.json` (or chat_template.jinja), else ChatML."""
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
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_path = d / "chat_template.jinja"
        if not isinstance(template, str) and jinja_path.is_file():
            template = jinja_path.read_text(encoding="utf-8")
        return cls(
            template if isinstance(template, str) else None,
            bos_token=_token_text(cfg.get("bos_token")),
            eos_token=_token_text(cfg.get("eos_token")),
        )

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
        marked = [*messages[:-1], {**messages[-1], "content": content + _CONTINUE_MARK}]
        text = self._render(marked, False, extra)
        if text.count(_CONTINUE_MARK) != 1:
            raise ContinuationError(
                "the chat template does not write the final message's content as given, so it cannot be continued"
            )
        return text[: text.index(_CONTINUE_MARK)]

    def _render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, extra: dict[str, Any] | None
    ) -> str:
        return self._template.render(
            {
                **(extra or {}),
                "messages": messages,
                "add_generation_prompt": add_generation_prompt,
                "bos_token": self.bos_token or "",
                "eos_token": self.eos_token or "",
            }
        )


def encode_rendered(tokenizer: Tokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
    """The ids of a rendered conversation. The template usually writes the BOS text itself, so a
    second BOS that the tokenizer adds in front of it is dropped."""
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    bos = tokenizer.bos_token_id
    if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    return ids
