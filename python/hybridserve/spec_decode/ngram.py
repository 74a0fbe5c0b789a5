"""N-gram prompt lookup: drafts copied from an earlier occurrence of the history's last n tokens.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the last n tokens of a row are looked
up in its history (prompt + output); at the most recent earlier occurrence, the up to k tokens
that followed it are the drafts (continued periodically when the copy reaches the end of the
history, so a short repetition still fills k drafts). The first n that matches wins (longest
match first). No weights: the proposal is a pure function of the history. The proposer keeps
each request's history between steps only to extend it by what is new
(`NgramProposer.propose_histories`).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from hybridserve.errors import ConfigError
from hybridserve.spec_decode.base import History, Proposer

_TOKEN_BYTES = array("q").itemsize


def ngram_lookup(tokens: Sequence[int] | np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Drafts for one history; see the module docstring."""
    if isinstance(tokens, np.ndarray):
        return _lookup(tokens.astype(np.int64).tobytes(), k, n_min, n_max)
    return _lookup(array("q", tokens).tobytes(), k, n_min, n_max)


def _lookup(buf: bytes | bytearray, k: int, n_min: int, n_max: int) -> list[int]:
    """`ngram_lookup` of a history given as 8-byte integers. Each n-gram is looked up with
    ``rfind`` (C speed; a hit at a byte offset that is not a whole token is skipped), n = n_max
    first: the first n that matches is the longest, and rfind gives its most recent earlier
    occurrence."""
    w = _TOKEN_BYTES
    length = len(buf) // w
    n_top = min(n_max, length - 1)
    if k <= 0 or n_top < n_min:
        return []
    for n in range(n_top, n_min - 1, -1):
        pattern = bytes(buf[w * (length - n) :])
        end = w * (length - 1)  # the occurrence must end before the last token (a token follows)
        at = buf.rfind(pattern, 0, end)
        while at > 0 and at % w:
            end = at + len(pattern) - 1  # the next occurrence to the left, even if it overlaps
            at = buf.rfind(pattern, 0, end)
        if at < 0:
            continue
        j = at // w + n - 1  # where the match ends
        # Copy what followed the match; where the copy runs into the history's end (a repetition
        # whose period is shorter than k), keep copying from the drafts, i.e. continue the period.
        drafts = array("q")
        drafts.frombytes(bytes(buf[w * (j + 1) : w * min(length, j + 1 + k)]))
        out = drafts.tolist()
        period = length - 1 - j
        while len(out) < k:
            out.append(out[len(out) - period])
        return out
    return []


class _KeptHistory:
    """A request's prompt and output as 8-byte integers, kept between steps and extended by the
    tokens output since (`extend`): a step's lookup then converts a few tokens, not the whole
    history (converting 64 histories of 1500 tokens whole cost 3.6 ms a step)."""

    __slots__ = ("prompt", "output", "counted", "buf")

    def __init__(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        self.prompt, self.output = prompt, output  # the lists it holds (others: a new history)
        self.counted = len(output)
        self.buf = bytearray(array("q", [*prompt, *output]).tobytes())

    def current(self, history: History) -> bool:
        return (
            history.prompt is self.prompt
            and history.output is self.output
            and len(history.output) >= self.counted
        )

    def extend(self, output: Sequence[int]) -> None:
        if len(output) > self.counted:
            self.buf += array("q", output[self.counted :]).tobytes()
            self.counted = len(output)


class NgramProposer(Proposer):
    """Prompt-lookup drafter (vLLM's `ngram` method, `prompt_lookup_min` / `prompt_lookup_max`)."""

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4) -> None:
        if not isinstance(prompt_lookup_min, int) or prompt_lookup_min < 1:
            raise ConfigError(
                f"--speculative-config: prompt_lookup_min must be a positive integer, got {prompt_lookup_min!r}"
            )
        if not isinstance(prompt_lookup_max, int) or prompt_lookup_max < prompt_lookup_min:
            raise ConfigError(
                "--speculative-config: prompt_lookup_max must be an integer >= prompt_lookup_min "
                f"({prompt_lookup_min}), got {prompt_lookup_max!r}"
            )
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self._kept: dict[str, _KeptHistory] = {}  # request id -> its history so far

    def propose(self, token_ids_per_row: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        return [
            ngram_lookup(row, k, self.prompt_lookup_min, self.prompt_lookup_max) for row in token_ids_per_row
        ]

    def propose_histories(
        self, request_ids: Sequence[str], histories: Sequence[History], k: int
    ) -> list[list[int]]:
        """`propose` of each request's kept history (`_KeptHistory`) with this step's tokens on
        its end while it is looked up: the same drafts as from the whole history."""
        drafts: list[list[int]] = []
        for rid, h in zip(request_ids, histories):
            kept = self._kept.get(rid)
            if kept is None or not kept.current(h):
                kept = self._kept[rid] = _KeptHistory(h.prompt, h.output)
            kept.extend(h.output)
            buf = kept.buf
            mark = len(buf)
            buf += array("q", h.new).tobytes()
            try:
                drafts.append(_lookup(buf, k, self.prompt_lookup_min, self.prompt_lookup_max))
            finally:
                del buf[mark:]
        return drafts

    def free(self, request_id: str) -> None:
        self._kept.pop(request_id, None)
