"""`--max-logprobs` (vLLM's flag; `max_logprobs` of EngineArgs and LLM): the most log-probabilities
per token a request may ask for, 20 by default, -1 for the whole vocabulary. A request over it is
refused before it runs, and a beam search, whose steps ask for 2 x beam_width, is bounded by it."""

from __future__ import annotations

import math

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.engine.beam_search import BeamSearchParams
from hybridserve.errors import ConfigError, InvalidRequestError

PROMPT = "The capital of France is"


def _top(llm: LLM, n: int) -> list[dict[int, float]]:
    out = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0, logprobs=n, prompt_logprobs=n))[
        0
    ]
    steps = out.outputs[0].logprobs
    assert steps is not None and len(steps) == 3
    return [{t: lp.logprob for t, lp in step.items()} for step in steps]


def test_the_default_is_vllm_s_twenty() -> None:
    llm = LLM("demo", dtype="float32", cpu_threads=1)
    assert llm.engine.max_logprobs == 20
    assert all(len(step) >= 20 for step in _top(llm, 20))  # (the sampled token may add one)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidRequestError, match=rf"{name}: at most 20 .*--max-logprobs.*got 21"):
            llm.generate([PROMPT], SamplingParams(max_tokens=1, **{name: 21}))
    assert llm.generate([PROMPT], SamplingParams(max_tokens=2))[0].outputs[0].token_ids  # (nothing broke)


def test_more_than_twenty_when_the_engine_allows_them() -> None:
    wide = LLM("demo", dtype="float32", cpu_threads=1, max_logprobs=50)
    every = LLM("demo", dtype="float32", cpu_threads=1, max_logprobs=-1)
    vocab = every.engine.vocab_size
    assert (wide.engine.max_logprobs, every.engine.max_logprobs) == (50, vocab)
    fifty, whole = _top(wide, 50), _top(every, vocab)
    for few, full in zip(fifty, whole, strict=True):
        assert len(few) in (50, 51) and len(full) == vocab
        # the whole distribution sums to one, and the 50 are its 50 most likely tokens
        assert math.isclose(sum(math.exp(v) for v in full.values()), 1.0, rel_tol=1e-4)
        best = sorted(full, key=lambda t: -full[t])[:50]
        assert set(best) <= set(few)
        assert all(math.isclose(few[t], full[t], abs_tol=1e-5) for t in best)
    with pytest.raises(InvalidRequestError, match=f"at most {vocab} "):
        every.generate([PROMPT], SamplingParams(max_tokens=1, logprobs=vocab + 1))


def test_a_limit_above_the_vocabulary_is_the_vocabulary() -> None:
    llm = LLM("demo", dtype="float32", cpu_threads=1, max_logprobs=10**6)
    assert llm.engine.max_logprobs == llm.engine.vocab_size


def test_a_beam_search_is_bounded_by_it() -> None:
    llm = LLM("demo", dtype="float32", cpu_threads=1, max_logprobs=5)
    with pytest.raises(InvalidRequestError, match=r"beam_width: at most 2 here .*--max-logprobs is 5"):
        llm.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=2))
    [out] = llm.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=2))
    assert len(out.sequences) == 2


@pytest.mark.parametrize("bad", [-2, 2**31, 1.5, True])
def test_a_bad_limit_is_a_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="--max-logprobs"):
        LLM("demo", max_logprobs=bad)
