"""N-gram prompt lookup: drafts copied from an earlier occurrence of the history's last n tokens.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the last n tokens of a row are looked
up in its history (prompt + output); at the most recent earlier occurrence, the up to k tokens
that followed it are the drafts (continued periodically when the copy reaches the end of the
history, so a short repetition still fills k drafts). The first n that matches wins (longest
match first). No weights,
no state: the proposal is a pure function of the history.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from hybridserve.errors import ConfigError
from hybridserve.spec_decode.base import Proposer

_TOKEN_BYTES = array("q").itemsize


def ngram_lookup(tokens: Sequence[int] | np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Drafts for one history; see the module docstring.

    The history as 8-byte integers, each n-gram looked up with ``bytes.rfind`` (C speed; a hit at
    a byte offset that is not a whole token is skipped), n = n_max first: the first n that
    matches is the longest, and rfind gives its most recent earlier occurrence."""
    length = len(tokens)
    n_top = min(n_max, length - 1)
    if k <= 0 or n_top < n_min:
        return []
    if isinstance(tokens, np.ndarray):
        buf = tokens.astype(np.int64).tobytes()
    else:
        buf = array("q", tokens).tobytes()
    w = _TOKEN_BYTES
    for n in range(n_top, n_min - 1, -1):
        pattern = buf[w * (length - n) :]
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
        drafts = [int(t) for t in tokens[j + 1 : j + 1 + k]]
        period = length - 1 - j
        while len(drafts) < k:
            drafts.append(drafts[len(drafts) - period])
        return drafts
    return []


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

    def propose(self, token_ids_per_row: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        return [
            ngram_lookup(row, k, self.prompt_lookup_min, self.prompt_lookup_max) for row in token_ids_per_row
        ]
