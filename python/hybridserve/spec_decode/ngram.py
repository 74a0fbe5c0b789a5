"""N-gram prompt lookup: drafts copied from an earlier occurrence of the history's last n tokens.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the last n tokens of a row are looked
up in its history (prompt + output); at the most recent earlier occurrence, the up to k tokens
that followed it are the drafts (continued periodically when the copy reaches the end of the
history, so a short repetition still fills k drafts). The first n that matches wins (longest
match first). No weights,
no state: the proposal is a pure function of the history. Lookups are vectorised with numpy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybridserve.errors import ConfigError
from hybridserve.spec_decode.base import Proposer


def ngram_lookup(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Drafts for one history (int array); see the module docstring."""
    length = int(tokens.shape[0])
    if k <= 0:
        return []
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n :]
        # Candidate starts i with i + n <= length - 1: earlier than the suffix itself, and at
        # least one token follows the match.
        head = tokens[: length - 1]
        cand = np.flatnonzero(head[: length - n] == suffix[0])
        if cand.size == 0:
            continue
        if n > 1:
            windows = np.lib.stride_tricks.sliding_window_view(head, n)
            cand = cand[(windows[cand] == suffix).all(axis=1)]
            if cand.size == 0:
                continue
        i = int(cand[-1])
        # Copy what followed the match; where the copy runs into the suffix itself (a repetition
        # whose period is shorter than k), keep copying from the drafts, i.e. continue the period.
        drafts: list[int] = tokens[i + n : i + n + k].tolist()
        period = length - n - i
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
            ngram_lookup(np.asarray(row, dtype=np.int64), k, self.prompt_lookup_min, self.prompt_lookup_max)
            for row in token_ids_per_row
        ]
