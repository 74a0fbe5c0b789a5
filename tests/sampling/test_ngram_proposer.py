"""N-gram prompt lookup proposer."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hybridserve.errors import ConfigError
from hybridserve.spec_decode.base import Proposals, Proposer
from hybridserve.spec_decode.ngram import NgramProposer


def reference(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Obviously-correct lookup: longest n first, most recent earlier occurrence."""
    length = len(tokens)
    for n in range(n_max, n_min - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n :]
        for i in range(length - n - 1, -1, -1):
            if tokens[i : i + n] == suffix:
                seq = list(tokens)
                for j in range(k):  # the copy continues into its own drafts
                    seq.append(seq[i + n + j])
                return seq[length:]
    return []


def test_copies_what_followed_the_last_ngram():
    p = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    assert p.propose([[1, 2, 3, 4, 5, 1, 2, 3]], 3) == [[4, 5, 1]]
    # Fewer than k tokens follow the match: the copy continues the period (9 7 8 | 9 7).
    assert p.propose([[7, 8, 9, 7, 8]], 5) == [[9, 7, 8, 9, 7]]
    # Continuation of a repetition overlaps the suffix itself.
    assert p.propose([[5, 6, 5, 6, 5, 6]], 4) == [[5, 6, 5, 6]]
    assert p.propose([[4, 4, 4]], 3) == [[4, 4, 4]]


def test_most_recent_occurrence_and_longest_n_first():
    p = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=2)
    # "1 2" occurs at 0 and 3; the most recent earlier one (3) is followed by 8.
    assert p.propose([[1, 2, 9, 1, 2, 8, 1, 2]], 2) == [[8, 1]]
    # n=2 ("4 2") matches at 0 though n=1 ("2") has a more recent match at 4: longest wins.
    assert p.propose([[4, 2, 6, 0, 2, 7, 4, 2]], 1) == [[6]]
    # Only n=1 matches.
    assert p.propose([[3, 9, 5, 1, 9]], 2) == [[5, 1]]


def test_no_match_short_history_and_k_zero():
    p = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=4)
    assert p.propose([[1, 2, 3, 4, 5]], 3) == [[]]
    assert p.propose([[1], [], [1, 1]], 3) == [[], [], []]
    assert p.propose([[1, 2, 1, 2]], 0) == [[]]
    # min 2: the single-token match "2 ... 2" is not enough.
    assert p.propose([[2, 5, 3, 2]], 2) == [[]]
    assert p.propose([[2, 5, 3, 2, 5, 4, 2, 5]], 2) == [[4, 2]]


def test_matches_the_reference_on_random_histories():
    rng = random.Random(0)
    p = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=4)
    p2 = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=3)
    rows = [
        [rng.randrange(rng.choice([2, 3, 5, 20])) for _ in range(rng.randrange(0, 60))] for _ in range(400)
    ]
    for k in (1, 3, 5):
        assert p.propose(rows, k) == [reference(r, k, 1, 4) for r in rows]
        assert p2.propose(rows, k) == [reference(r, k, 2, 3) for r in rows]


def test_interface_defaults_and_validation():
    p = NgramProposer()
    assert isinstance(p, Proposer)
    assert (p.prompt_lookup_min, p.prompt_lookup_max) == (1, 4)
    hist = [[1, 2, 3, 1, 2]]
    assert p.propose_for(["r0"], hist, 2) == p.propose(hist, 2) == [[3, 1]]
    assert p.propose_with_probs(["r0"], hist, 2) == Proposals(draft_token_ids=[[3, 1]], draft_probs=None)
    p.free("r0")  # stateless: nothing to forget
    with pytest.raises(ConfigError):
        NgramProposer(prompt_lookup_min=0)
    with pytest.raises(ConfigError):
        NgramProposer(prompt_lookup_min=3, prompt_lookup_max=2)


def test_large_token_ids_and_array_histories():
    # ids past 2**31 and numpy histories take the same lookup as small ids in lists
    from hybridserve.spec_decode.ngram import ngram_lookup

    big = [2**40 + t for t in (1, 2, 3, 1, 2)]
    assert ngram_lookup(big, 2, 1, 3) == [2**40 + 3, 2**40 + 1]
    rng = random.Random(1)
    for _ in range(50):
        row = [rng.randrange(4) * 257 for _ in range(rng.randrange(1, 40))]  # bytes that repeat inside ids
        assert ngram_lookup(np.asarray(row), 3, 1, 4) == ngram_lookup(row, 3, 1, 4) == reference(row, 3, 1, 4)


def test_a_kept_history_proposes_what_the_whole_history_does():
    # The engine passes each request's own lists (the output only grows) and this step's tokens;
    # the proposer keeps the history and adds what is new. Every step must give the drafts of the
    # whole history, for requests that come, grow, get another list, and go.
    from hybridserve.spec_decode.base import History

    rng = random.Random(11)
    p = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=4)
    prompts = {f"r{i}": [rng.randrange(6) for _ in range(rng.randrange(1, 40))] for i in range(5)}
    outputs: dict[str, list[int]] = {rid: [] for rid in prompts}
    for step in range(60):
        ids = sorted(prompts)
        new = {rid: [rng.randrange(6) for _ in range(rng.randrange(1, 4))] for rid in ids}
        histories = [History(prompts[rid], outputs[rid], new[rid]) for rid in ids]
        got = p.propose_histories(ids, histories, 3)
        assert got == p.propose([h.tokens() for h in histories], 3), step
        for rid in ids:
            outputs[rid].extend(new[rid])
        if step == 20:  # a request gone, and another in its place under the same id
            p.free("r0")
            prompts["r0"], outputs["r0"] = [1, 2, 3], []
        if step == 40:  # a request whose output list was replaced is read anew
            outputs["r1"] = list(outputs["r1"][:5])
    assert set(p._kept) == set(prompts)
    for rid in list(prompts):
        p.free(rid)
    assert not p._kept


def test_a_history_reads_from_any_position_across_its_parts():
    from hybridserve.spec_decode.base import History

    h = History([1, 2, 3], [4, 5], [6])
    assert len(h) == 6 and h.tokens() == [1, 2, 3, 4, 5, 6]
    for start in range(8):
        assert h.tokens_from(start) == h.tokens()[start:], start
    assert History([], [], [7]).tokens_from(0) == [7] and len(History([], [], [])) == 0
