"""vLLM's allowed_token_ids and bad_words (SamplingParams): every other token, or a bad word's
last token where the output ends with the rest of it, is forbidden in the plain sampler and at
every position of the speculative verify path; neither leaves a row without a token to draw."""

from __future__ import annotations

import random

import pytest
import torch

from hybridserve.errors import InvalidRequestError
from hybridserve.sampling.params import MAX_BAD_WORD_LEN, MAX_BAD_WORDS, SamplingParams
from hybridserve.sampling.rejection import RejectionSampler
from hybridserve.sampling.sampler import BadWordIndex, RowSampling, Sampler, processed_probs


def banned_next_tokens(sequences, output, extra=()):  # type: ignore[no-untyped-def]
    return BadWordIndex(sequences).banned_after(output, extra)


VOCAB = 16


def _logits(n: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, VOCAB), generator=g, dtype=torch.float64) * 3


def test_allowed_token_ids_keep_greedy_and_random_rows_inside_them():
    logits = _logits()
    ranked = logits[0].argsort(descending=True).tolist()
    allowed = [ranked[5], ranked[6]]  # neither is the argmax
    sampler = Sampler()
    greedy = RowSampling(SamplingParams(temperature=0.0, allowed_token_ids=allowed))
    assert int(sampler.sample(logits, [greedy]).token_ids[0]) == ranked[5]
    rows = [
        RowSampling(SamplingParams(temperature=1.0, seed=s, allowed_token_ids=allowed)) for s in range(40)
    ]
    drawn = set(sampler.sample(logits.expand(40, VOCAB), rows).token_ids.tolist())
    assert drawn == set(allowed)  # both drawn, nothing else
    # the distribution is the model's renormalised over the allowed tokens
    p = processed_probs(logits, rows[:1])[0]
    expected = torch.softmax(logits[0, allowed], dim=-1)
    assert torch.allclose(p[allowed], expected) and float(p.sum() - p[allowed].sum()) == 0.0


def test_bad_words_forbid_a_last_token_only_after_the_rest_of_the_word():
    assert banned_next_tokens([(7,), (3, 4), (1, 2, 5)], output=[9, 1], extra=[2]) == [7, 5]
    assert banned_next_tokens([(3, 4)], output=[3], extra=()) == [4]
    assert banned_next_tokens([(3, 4)], output=[3], extra=[8]) == []  # a draft after it breaks it
    assert banned_next_tokens([(1, 2, 5)], output=[], extra=[1]) == []  # too short a history
    assert banned_next_tokens([(1, 2, 5)], output=[], extra=[0, 1, 2]) == [5]
    logits = _logits()
    top = int(logits[0].argmax())
    other = (top + 1) % VOCAB
    sampler = Sampler()
    word = ((other, top),)
    after_word = RowSampling(SamplingParams(temperature=0.0), output_token_ids=[other], bad_word_ids=word)
    elsewhere = RowSampling(SamplingParams(temperature=0.0), output_token_ids=[top], bad_word_ids=word)
    second = int(logits[0].topk(2).indices[1])
    assert sampler.sample(logits.expand(2, VOCAB), [after_word, elsewhere]).token_ids.tolist() == [
        second,
        top,
    ]


def test_the_indexed_bans_are_the_sequences_the_history_ends_before():
    rng = random.Random(0)
    for _ in range(3000):
        seqs = [tuple(rng.randrange(4) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 5))]
        output = [rng.randrange(4) for _ in range(rng.randint(0, 5))]
        extra = [rng.randrange(4) for _ in range(rng.randint(0, 3))]
        history = output + extra
        naive = sorted(
            s[-1]
            for s in seqs
            if len(s) == 1
            or (len(history) >= len(s) - 1 and tuple(history[len(history) - len(s) + 1 :]) == s[:-1])
        )
        assert sorted(banned_next_tokens(seqs, output, extra)) == naive, (seqs, output, extra)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_verify_path_applies_the_bans_over_the_drafts(temperature):
    # each position sees the output plus the drafts before it: drafts equal to the plain
    # sampler's own choices over the same history are all accepted
    k = 3
    logits = _logits(k + 1, seed=1)
    params = SamplingParams(temperature=temperature, seed=7, allowed_token_ids=list(range(0, VOCAB, 2)))
    sampler = Sampler()
    history: list[int] = [4]
    expected = []
    words: tuple[tuple[int, ...], ...] = ()
    for j in range(k + 1):
        if j == 1:  # a word whose first token the output now ends with, banned at the next position
            words = ((history[-1], int(logits[j][::2].argmax()) * 2),)
        row = RowSampling(params, seed=7, output_token_ids=list(history), bad_word_ids=words)
        expected.append(int(sampler.sample(logits[j : j + 1], [row]).token_ids[0]))
        history.append(expected[-1])
    assert all(t % 2 == 0 for t in expected)
    row = RowSampling(params, seed=7, output_token_ids=[4], bad_word_ids=words)
    out = RejectionSampler().sample(logits, torch.tensor(expected[:k]), [row], num_draft_tokens=[k])
    assert out.num_accepted == [k] and out.token_ids[0] == expected


def test_a_ban_that_would_leave_no_token_is_left_out():
    logits = _logits()
    sampler = Sampler()
    # the bad word forbids the only allowed token: allowed_token_ids stands, the word gives way
    row = RowSampling(SamplingParams(temperature=0.0, allowed_token_ids=[3]), bad_word_ids=((3,),))
    assert int(sampler.sample(logits, [row]).token_ids[0]) == 3
    # min_tokens does not forbid the only allowed token (EOS) either
    eos = RowSampling(
        SamplingParams(temperature=1.0, min_tokens=4, allowed_token_ids=[2]), seed=1, eos_token_id=2
    )
    assert int(sampler.sample(logits, [eos]).token_ids[0]) == 2
    assert torch.isfinite(processed_probs(logits, [eos])).all()


@pytest.mark.parametrize(
    "kw,word",
    [
        ({"allowed_token_ids": []}, "allowed_token_ids: must be a non-empty list"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"allowed_token_ids": [True]}, "allowed_token_ids"),
        ({"bad_words": ["ok", " "]}, "bad_words: must be a list of strings that are not empty or blank"),
        ({"bad_words": "word"}, "bad_words"),
        ({"bad_words": ["w"] * (MAX_BAD_WORDS + 1)}, f"at most {MAX_BAD_WORDS} words"),
        ({"bad_words": ["w" * (MAX_BAD_WORD_LEN + 1)]}, f"at most {MAX_BAD_WORD_LEN} characters"),
    ],
)
def test_params_refuse_bad_values_naming_the_field(kw, word):
    with pytest.raises(InvalidRequestError, match=word):
        SamplingParams(**kw)
