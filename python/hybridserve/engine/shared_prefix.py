"""Declared shared prefixes: where a prompt's part that other prompts will share ends.

A hybrid model resumes a cached prefix only where a copy of its Mamba state was kept. Branch
placement keeps one where a second request finds that an earlier one computed the same prefix, so
the second user of a system prompt still computes it, and only the third hits
(docs/prefix-caching.md, "Declared shared prefixes"). A chat prompt says where its system message
ends: the chat template closes every message with an end-of-message token. The engine declares the
prompt up to the first such token shared (`Scheduler.add_request(shared_prefix_len=)`), and the
first request that computes it keeps the state there, so the second user already hits it.

`--shared-prefix-markers`: "auto" (the end-of-message token of the model's chat template), "none",
or token ids separated by commas.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hybridserve.config.args import check_marker_ids, parse_shared_prefix_markers
from hybridserve.engine.chat_template import ChatTemplate

if TYPE_CHECKING:
    from hybridserve.engine.tokenizer import Tokenizer

# Message contents the template is rendered with to find what it writes between two messages.
_SYSTEM_PROBE = "hybridserve-system-probe"
_USER_PROBE = "hybridserve-user-probe"


def template_message_end_ids(
    model_dir: str | Path, tokenizer: Tokenizer, template: ChatTemplate | None = None
) -> tuple[tuple[int, ...], str]:
    """(ids, why): the special token the chat template (`template`, else the model's) writes right
    after a message's content (ChatML's `<|im_end|>`, Llama 3's `<|eot_id|>`), found by rendering
    a system and a user message and tokenizing what lies between them. No template, or nothing
    special between the two messages: no ids, and why."""
    try:
        if template is None:
            template = ChatTemplate.from_model_dir(model_dir)
        text = template.render(
            [{"role": "system", "content": _SYSTEM_PROBE}, {"role": "user", "content": _USER_PROBE}],
            add_generation_prompt=False,
        )
    except Exception as e:  # a template that cannot render two plain messages declares nothing
        return (), f"the chat template did not render a system and a user message ({e})"
    start = text.find(_SYSTEM_PROBE)
    end = text.find(_USER_PROBE)
    if start < 0 or end < start:
        return (), "the chat template does not write a system message before a user message"
    between = tokenizer.encode(text[start + len(_SYSTEM_PROBE) : end], add_special_tokens=False)
    special = [t for t in between if tokenizer.is_special(t)]
    if not special:
        return (), "the chat template writes no special token between two messages"
    tok = special[0]
    return (tok,), f"the chat template ends a message with token {tok} ({tokenizer.id_to_token(tok)!r})"


def resolve_markers(
    setting: str | Sequence[int],
    model_dir: str | Path,
    tokenizer: Tokenizer,
    template: ChatTemplate | None = None,
) -> tuple[tuple[int, ...], str]:
    """(marker ids, why) for an engine: `setting` as `parse_shared_prefix_markers` takes it;
    "auto" reads `template` (the served one), else the model's."""
    parsed = parse_shared_prefix_markers(setting)
    if parsed == "none":
        return (), "--shared-prefix-markers none"
    if parsed == "auto":
        return template_message_end_ids(model_dir, tokenizer, template)
    assert isinstance(parsed, tuple)
    check_marker_ids(parsed, tokenizer.vocab_size)
    return parsed, f"--shared-prefix-markers {','.join(map(str, parsed))}"


def shared_prefix_len(prompt: Sequence[int], markers: Sequence[int]) -> int | None:
    """The length of `prompt` up to and including its first marker token (the end of its first
    message: a chat's system message), or None without one."""
    first: int | None = None
    for m in markers:
        try:
            i = prompt.index(m) if first is None else prompt.index(m, 0, first)
        except ValueError:
            continue
        first = i
    return None if first is None else first + 1
