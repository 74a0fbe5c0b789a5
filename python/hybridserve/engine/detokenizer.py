"""Incremental detokenization and stop strings for one sequence.

Byte-level BPE tokens can split a UTF-8 character, so the text of a token on its own is not its
contribution to the text. Each step decodes only a short window: the tokens since the last point
where the text was complete (`_prefix_offset`), and compares it with the decode of the window
without the new tokens; the difference is the new text. A trailing replacement character means an
unfinished character, held back until more tokens (or the end) arrive. The cost per token is
constant, not proportional to the length of the output.

`deferred=True` (the offline `LLM.generate` path, where nobody reads the text before the end): with
no stop strings to watch for, tokens are only collected and the text is decoded once, when the
final call comes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


_INCOMPLETE = "\ufffd"


@dataclass
class IncrementalDetokenizer:
    tokenizer: Decoder
    stop: Sequence[str] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # A stop string counts only when it ends in the text of a token after the first min_tokens
    # (as vLLM; stop tokens are masked for those tokens too).
    min_tokens: int = 0
    # Decode once at the end instead of per token (only when there are no stop strings).
    deferred: bool = False
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # text released so far
    stopped_by: str | None = None  # the stop string that matched, if any
    _decoded: str = ""  # text decoded so far (complete characters); `text` is a prefix of it
    _prefix_offset: int = 0  # token_ids[:_prefix_offset] are fully represented in _decoded
    _read_offset: int = 0  # token_ids[:_read_offset] have been decoded into _decoded

    def _decode_window(self, final: bool) -> str:
        ids = self.token_ids
        skip = self.skip_special_tokens
        before = self.tokenizer.decode(ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        after = self.tokenizer.decode(ids[self._prefix_offset :], skip_special_tokens=skip)
        if not final and (len(after) <= len(before) or after.endswith(_INCOMPLETE)):
            return self._decoded  # the new tokens end inside a character: wait for more
        if after.startswith(before):
            self._decoded += after[len(before) :]
        else:  # a new token changed how the window decodes; keep what was decoded before
            self._decoded += after[len(before) :] if len(after) > len(before) else ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        return self._decoded

    def add_tokens(self, new_ids: Sequence[int], final: bool = False) -> str:
        """Append tokens; return the newly released text. Once a stop string matched, the text is
        cut there and `stopped_by` is set; later calls return ''."""
        if self.stopped_by is not None:
            return ""
        self.token_ids.extend(int(t) for t in new_ids)
        if self.deferred and not self.stop:
            if not final or (self._read_offset == len(self.token_ids) and self.text):
                return ""  # not the end yet, or already decoded up to the last token
            self._read_offset = len(self.token_ids)
            full = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
            delta = full[len(self.text) :] if full.startswith(self.text) else ""
            self.text = full if full.startswith(self.text) else self.text
            return delta
        full = self._decode_window(final)
        if not full.startswith(self.text):
            # Rare: a later token changed how earlier bytes decode. Never take back released text.
            full = self.text + full[len(self.text) :]
        if self.stop and len(self.token_ids) > self.min_tokens:
            # The first stop string to be completed wins: the match that ends first, as if the
            # text arrived one character at a time (the one that starts first on a tie). Only
            # matches that end in text not yet released count: released text was either
            # searched already or produced by the first min_tokens tokens.
            best: tuple[int, int, str] | None = None  # (end, start, stop string)
            for s in self.stop:
                i = full.find(s, max(0, len(self.text) - len(s) + 1))
                if i != -1 and (best is None or (i + len(s), i) < best[:2]):
                    best = (i + len(s), i, s)
            if best is not None:
                end, i, s = best
                self.stopped_by = s
                cut = end if self.include_stop_str_in_output else i
                full = full[: max(cut, len(self.text))]
                delta = full[len(self.text) :]
                self.text = full
                return delta
        if self.stop and not final:
            # Hold back a tail that could be the start of a stop string, also before min_tokens:
            # a stop completed by a later token must still be cut from the text.
            hold = 0
            for s in self.stop:
                for n in range(min(len(s) - 1, len(full)), 0, -1):
                    if full.endswith(s[:n]):
                        hold = max(hold, n)
                        break
            if hold:
                full = full[: max(len(full) - hold, len(self.text))]
        delta = full[len(self.text) :]
        self.text = full
        return delta
