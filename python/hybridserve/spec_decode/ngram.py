"""N-gram prompt lookup: drafts copied from an earlier occurrence of the history's last n tokens.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the last n tokens of a row are looked
up in its history (prompt + output); at the most recent earlier occurrence, the up to k tokens
that followed it are the drafts (continued periodically when the copy reaches the end of the
history, so a short repetition still fills k drafts). The first n that matches wins (longest
match first). No weights,
no state: the proposal is a pure function of the history. The lookup is one vectorised pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybridserve.errors import ConfigError
from hybridserve.spec_decode.base import Proposer


def ngram_lookup(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Drafts for one history (int array); see the module docstring.

    One pass instead of one per n: every earlier position j holding the last token is a candidate
    match end, its match length is how far back it agrees with the history's end (capped at
    n_max, and at j + 1 and length - 1), and the longest match wins, the most recent among equals:
    the same choice as trying n = n_max, ..., n_min in turn."""
    length = int(tokens.shape[0])
    n_top = min(n_max, length - 1)
    if k <= 0 or n_top < n_min:
        return []
    # candidate ends j <= length - 2 (a token follows the match)
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    if ends.size == 0:
        return []
    match = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for t in range(1, n_top):
        back = ends - t
        ok = back >= 0
        alive &= ok
        alive[ok] &= tokens[back[ok]] == tokens[length - 1 - t]
        if not alive.any():
            break
        match += alive
    best = int(match.max())
    if best < n_min:
        return []
    j = int(ends[np.flatnonzero(match == best)[-1]])
    # Copy what followed the match; where the copy runs into the history's end (a repetition
    # whose period is shorter than k), keep copying from the drafts, i.e. continue the period.
    drafts: list[int] = tokens[j + 1 : j + 1 + k].tolist()
    period = length - 1 - j
    while len(drafts) < k:
        drafts.append(drafts[len(drafts) - period])
    return drafts


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
            ngram_lookup(np.asarray(row, dtype=np.int64), k, self.prompt_lookup_min, self.prompt_lookup_max)
            for row in token_ids_per_row
        ]
