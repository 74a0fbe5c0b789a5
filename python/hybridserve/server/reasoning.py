"""Reasoning outputs: a thinking model's answer split into its reasoning and its content.

With `--reasoning-parser deepseek_r1` (vLLM's name; the `<think> ... </think>` form of DeepSeek-R1,
QwQ and the Nemotron-H reasoning models), a chat answer's text before the first `</think>` is its
reasoning, and the text after it its content. An opening `<think>` at the start of the answer
(after any whitespace) is dropped; without it the answer still begins inside its reasoning (the
chat template often ends the prompt with `<think>`). An answer without `</think>` is all
reasoning: it was cut off while thinking. The reasoning goes to the message's `reasoning` field
and to `reasoning_content`, its older name that many clients still read.

A stream is split the same way, delta by delta (`ReasoningSplitter`): text that may be the start
of a tag is held back until the next delta says whether it is one, so the deltas of each kind add
up to the fields of the answer the same request gets unstreamed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# vLLM's --reasoning-parser names this server knows. nano_v2 and nano_v3 are the names of the
# plugins NVIDIA ships with its Nemotron Nano models: deepseek_r1's split, plus an answer with
# thinking switched off being content, which this server does for every parser (app.py).
REASONING_PARSERS = ("deepseek_r1", "nano_v2", "nano_v3")


@dataclass(frozen=True)
class ReasoningFormat:
    """The tags that open and close a reasoning part."""

    name: str
    start: str = "<think>"
    end: str = "</think>"


def reasoning_format(name: str) -> ReasoningFormat:
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning parser: one of {', '.join(REASONING_PARSERS)}, got {name!r}")
    return ReasoningFormat(name)


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (the longest such suffix)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """One answer's text, fed delta by delta, as (reasoning, content) pieces."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self._state: Literal["start", "reasoning", "content"] = "start"
        self._held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and the content that `text` settles (`final`: the answer ends here, so
        nothing is held back any more)."""
        held = self._held + text
        reasoning = content = ""
        if self._state == "start":
            lead = held.lstrip()
            if lead.startswith(self.fmt.start):
                held = lead[len(self.fmt.start) :]
                self._state = "reasoning"
            elif self.fmt.start.startswith(lead) and not final:
                self._held = held  # (maybe the opening tag, not all of it here yet)
                return "", ""
            else:
                self._state = "reasoning"
        if self._state == "reasoning":
            at = held.find(self.fmt.end)
            if at < 0:
                keep = 0 if final else _held_back(held, self.fmt.end)
                reasoning, held = held[: len(held) - keep], held[len(held) - keep :]
            else:
                reasoning, held = held[:at], held[at + len(self.fmt.end) :]
                self._state = "content"
        if self._state == "content":
            content, held = held, ""
        self._held = held
        return reasoning, content


def split_reasoning(fmt: ReasoningFormat, text: str) -> tuple[str, str]:
    """(reasoning, content) of a whole answer: what a stream of it adds up to."""
    return ReasoningSplitter(fmt).feed(text, final=True)
