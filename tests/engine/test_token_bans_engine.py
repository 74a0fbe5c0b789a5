"""allowed_token_ids and bad_words through the offline engine: the output holds only allowed
tokens and never a bad word's tokens; with n-gram speculation a request emits the same tokens as
without it, and a neighbour without them in the same batch is unchanged."""

from __future__ import annotations

import random

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.engine.input_processor import bad_word_sequences
from hybridserve.errors import InvalidRequestError

MAX_TOKENS = 24
SPEC = {"method": "ngram", "num_speculative_tokens": 3}


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    motif = [rng.randrange(3, 780) for _ in range(6)]
    return [(motif * 10)[:60], [rng.randrange(3, 780) for _ in range(30)]]


def _run(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()[: len(params)]], params)
    return [list(o.outputs[0].token_ids) for o in outs]


def _contains(seq: list[int], sub: tuple[int, ...]) -> bool:
    return any(tuple(seq[i : i + len(sub)]) == sub for i in range(len(seq) - len(sub) + 1))


@pytest.fixture(scope="module")
def llms() -> tuple[LLM, LLM]:
    plain = LLM("demo", dtype="float64", max_model_len=256, seed=0)
    spec = LLM("demo", dtype="float64", max_model_len=256, seed=0, speculative_config=SPEC)
    return plain, spec


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_bans_hold_and_speculation_does_not_change_them(llms, temperature) -> None:
    plain_llm, spec_llm = llms
    common = {"max_tokens": MAX_TOKENS, "temperature": temperature, "seed": 3, "ignore_eos": True}
    free = SamplingParams(**common)
    neighbour = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=5, ignore_eos=True)
    reference = _run(plain_llm, [free, neighbour])
    # ban what the free run says: its words, and all but a few of the tokens it used
    text = plain_llm.get_tokenizer().decode(reference[0])
    words = sorted({w for w in text.split() if w.isalpha()})[:4] or ["the"]
    allowed = sorted(set(range(3, 795)) - set(reference[0][:3]))
    tok = plain_llm.get_tokenizer()
    accepted_before = int(spec_llm.engine.stats()["spec_decode_accepted_tokens"])
    for kw in ({"bad_words": words}, {"allowed_token_ids": allowed}):
        params = SamplingParams(**common, **kw)
        without_spec = _run(plain_llm, [params, neighbour])
        with_spec = _run(spec_llm, [params, neighbour])
        assert with_spec == without_spec, kw
        assert without_spec[0] != reference[0] and without_spec[1] == reference[1], kw
        if "allowed_token_ids" in kw:
            assert set(without_spec[0]) <= set(allowed)
        else:
            for seq in bad_word_sequences(tok, words):
                assert not _contains(without_spec[0], seq), (seq, without_spec[0])
    if temperature == 0.0:  # drafts were verified against the banned target and accepted
        assert int(spec_llm.engine.stats()["spec_decode_accepted_tokens"]) > accepted_before


def test_allowed_token_ids_outside_the_vocabulary_are_refused(llms) -> None:
    with pytest.raises(InvalidRequestError, match=r"allowed_token_ids: token ids must be in \[0, 795\)"):
        llms[0].generate(["x"], SamplingParams(allowed_token_ids=[1, 795]))
