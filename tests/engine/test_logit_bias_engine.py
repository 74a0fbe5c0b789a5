"""logit_bias through the offline engine: with n-gram speculation a biased request emits the same
tokens as without it, and a request without logit_bias in the same batch is unchanged."""

from __future__ import annotations

import random

from hybridserve import LLM, SamplingParams

MAX_TOKENS = 24


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    motif = [rng.randrange(3, 780) for _ in range(6)]
    return [(motif * 10)[:60], [rng.randrange(3, 780) for _ in range(30)]]


ACCEPTED: list[int] = []


def _run(spec: dict[str, object] | None, params: list[SamplingParams]) -> list[list[int]]:
    llm = LLM("demo", dtype="float64", max_model_len=256, seed=0, speculative_config=spec)
    prompts = _prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[: len(params)]], params)
    if spec is not None:
        ACCEPTED.append(int(llm.engine.stats()["spec_decode_accepted_tokens"]))
    return [list(o.outputs[0].token_ids) for o in outs]


def test_logit_bias_with_ngram_speculation_and_an_unbiased_neighbour() -> None:
    motif = _prompts()[0][:6]
    # push the motif's tokens up (drafts get accepted) and forbid one of them
    bias = {t: 4.0 for t in motif[1:]}
    bias[motif[0]] = -100.0
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    for temperature in (0.0, 0.9):
        biased = SamplingParams(
            max_tokens=MAX_TOKENS, temperature=temperature, seed=3, ignore_eos=True, logit_bias=bias
        )
        plain = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=5, ignore_eos=True)
        unbiased = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=3, ignore_eos=True)
        without_spec = _run(None, [biased, plain])
        with_spec = _run(spec, [biased, plain])
        assert with_spec == without_spec, temperature
        assert motif[0] not in without_spec[0]
        # the bias changed the biased request, and nothing of its unbiased neighbour's
        reference = _run(None, [unbiased, plain])
        assert reference[0] != without_spec[0]
        assert reference[1] == without_spec[1]
    assert sum(ACCEPTED) > 0  # drafts were verified against the biased target and accepted
