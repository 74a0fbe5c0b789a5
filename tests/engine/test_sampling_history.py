"""Every step samples a request's row with its whole history so far: a penalty over the prompt
and the output sees each token the request has emitted, at every step (the engine keeps one
sampling row per request across steps, holding the request's growing output)."""

from __future__ import annotations

import random

from hybridserve import LLM, SamplingParams


def test_every_step_samples_with_the_history_so_far() -> None:
    llm = LLM("demo", dtype="float64", cpu_threads=1, max_model_len=256, seed=0)
    rng = random.Random(3)
    prompt = [rng.randrange(3, 780) for _ in range(20)]
    n = 24

    def params(max_tokens: int, penalty: float) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, temperature=0, repetition_penalty=penalty, ignore_eos=True
        )

    whole = list(llm.generate({"prompt_token_ids": prompt}, params(n, 3.0))[0].outputs[0].token_ids)
    # the same continuation one token per request, each prompt holding every token so far (the
    # repetition penalty covers the prompt and the output alike)
    seq = list(prompt)
    for _ in range(n):
        out = llm.generate({"prompt_token_ids": seq}, params(1, 3.0))[0].outputs[0].token_ids
        seq.append(out[0])
    assert whole == seq[len(prompt) :]
    # and the penalty decided tokens here: without it greedy decoding goes elsewhere
    plain = list(llm.generate({"prompt_token_ids": prompt}, params(n, 1.0))[0].outputs[0].token_ids)
    assert plain != whole
