"""Losslessness of seeded random sampling: with temperature, top-k/top-p and penalties, the float64
demo model emits the same tokens whatever the cache mode, prefix hits, chunk budget, preemption and
speculative decoding (n-gram or draft model). Every draw is keyed by (request seed, output position)
(sampling/sampler.py) and a verify step compares the drafts with exactly those draws
(sampling/rejection.py), so a speculative run is not just equal in distribution: it is equal token
for token. Unseeded requests get a seed derived from the engine seed and their arrival index, so
they are reproducible across engines given the same submission order too."""

from __future__ import annotations

from functools import cache

import pytest
from test_engine_lossless import PREEMPTING, _llm, _prompts, mode_args

from hybridserve import LLM, SamplingParams

MAX_TOKENS = 24


def _params() -> list[SamplingParams]:
    base = dict(max_tokens=MAX_TOKENS, ignore_eos=True)
    return [
        SamplingParams(temperature=0.7, top_k=20, seed=11, **base),
        SamplingParams(temperature=1.0, top_p=0.9, seed=12, repetition_penalty=1.2, **base),
        SamplingParams(temperature=0.8, min_p=0.05, **base),  # unseeded: engine seed + index
        SamplingParams(temperature=0.5, top_k=5, seed=14, frequency_penalty=0.3, **base),
        SamplingParams(temperature=0.0, **base),  # a greedy row in the same batches
        SamplingParams(temperature=0.9, seed=16, presence_penalty=0.5, min_tokens=3, **base),
    ]


def _run(llm: LLM) -> list[tuple[int, ...]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], _params())
    return [tuple(o.outputs[0].token_ids) for o in outs]


@cache
def reference() -> tuple[tuple[int, ...], ...]:
    """One request at a time, no prefix caching, whole prompts in one step, no speculation."""
    llm = _llm(enable_prefix_caching=False, max_num_batched_tokens=1024, max_num_seqs=1)
    return tuple(_run(llm))


def _assert_same(got: list[tuple[int, ...]]) -> None:
    ref = reference()
    assert len(got) == len(ref)
    for i, (g, r) in enumerate(zip(got, ref)):
        assert g == r, f"prompt {i}: {list(g)} != {list(r)}"


def test_reference_is_random_and_seeded() -> None:
    ref = reference()
    assert all(len(r) == MAX_TOKENS for r in ref)
    # Sampling, not argmax: the seeded rows differ from the greedy output of the same prompt.
    greedy = _llm(enable_prefix_caching=False, max_num_seqs=1).generate(
        [{"prompt_token_ids": p} for p in _prompts()],
        SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0),
    )
    assert sum(ref[i] != tuple(greedy[i].outputs[0].token_ids) for i in (0, 1, 2, 3, 5)) >= 4
    # Another seed, another output.
    params = _params()
    params[0] = SamplingParams(temperature=0.7, top_k=20, seed=99, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = _llm(enable_prefix_caching=False, max_num_seqs=1)
    other = llm.generate([{"prompt_token_ids": _prompts()[0]}], params[0])[0]
    assert tuple(other.outputs[0].token_ids) != ref[0]


@pytest.mark.parametrize("mode", ["none", "align", "all"])
def test_cache_modes_chunking_and_prefix_hits(mode: str) -> None:
    llm = _llm(
        **mode_args(mode),
        max_num_batched_tokens=64,
    )
    _assert_same(_run(llm))
    # The same engine again: the unseeded request is the 13th to arrive now, so it gets another
    # derived seed; the seeded ones must come back identical, with prefix hits.
    again = _run(llm)
    ref = reference()
    assert [again[i] for i in (0, 1, 3, 4, 5)] == [ref[i] for i in (0, 1, 3, 4, 5)]


def test_preemption() -> None:
    llm = _llm(**mode_args("all"), **PREEMPTING)
    _assert_same(_run(llm))
    assert llm.engine.stats()["num_preemptions_total"] > 0


@pytest.mark.parametrize(
    ("mode", "spec"),
    [
        ("align", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}),
        ("none", {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1}),
        ("align", {"method": "draft_model", "num_speculative_tokens": 3, "model": "demo"}),
        ("all", {"method": "draft_model", "num_speculative_tokens": 2, "model": "demo"}),
    ],
)
def test_speculative_decoding(mode: str, spec: dict[str, object]) -> None:
    llm = _llm(
        **mode_args(mode),
        max_num_batched_tokens=128,
        speculative_config=spec,
    )
    _assert_same(_run(llm))
    stats = llm.engine.stats()
    # Drafts of random rows were both accepted and rejected: both branches of verification ran.
    assert stats["spec_decode_accepted_tokens"] > 0
    assert stats["spec_decode_accepted_tokens"] < stats["spec_decode_draft_tokens"]
    assert stats["num_steps"] < len(_prompts()) * MAX_TOKENS


def test_speculation_with_preemption() -> None:
    llm = _llm(
        **mode_args("align"),
        **PREEMPTING,
        speculative_config={"method": "draft_model", "num_speculative_tokens": 3, "model": "demo"},
    )
    _assert_same(_run(llm))
    stats = llm.engine.stats()
    assert stats["num_preemptions_total"] > 0 and stats["spec_decode_accepted_tokens"] > 0
