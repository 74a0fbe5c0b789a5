"""A failure that belongs to one request fails that request alone: fault injection into one row
of a batch of 8 (non-finite logits; an error while sampling it). The other seven produce exactly
what they produce without the fault, nothing leaks, and the prefix cache keeps serving hits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from hybridserve.engine.llm import LLM
from hybridserve.sampling.params import SamplingParams

SHARED = "The committee met on a grey morning to discuss the harbour, the bridges and the trains. "
PROMPTS = [SHARED + f"Item {i}: the answer to question {i} is" for i in range(8)]
VICTIM = 3
VICTIM_SEED = 987_654  # marks the victim's rows for the sampling fault


def params() -> list[SamplingParams]:
    # greedy and seeded random rows both: a seeded row must sample the same draws after a fault
    out = [
        SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 0.8, seed=100 + i, ignore_eos=True)
        for i in range(8)
    ]
    out[VICTIM] = SamplingParams(max_tokens=12, temperature=0.8, seed=VICTIM_SEED, ignore_eos=True)
    return out


def make_llm() -> LLM:
    return LLM("demo", dtype="float32", max_model_len=512, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return [list(r.outputs[0].token_ids) for r in make_llm().generate(PROMPTS, params())]


def inject_nan_logits(llm: LLM, victim_prompt: str, at_step: int) -> Callable[[], int]:
    """From the victim's `at_step`-th sampled row on, its logits are NaN. Returns a counter."""
    runner = llm.engine.runner
    original = runner._sample
    seen = {"rows": 0, "injected": 0}

    def sample(
        out: Any, slots: Any, rows: Any, logits: torch.Tensor, result: Any, finite: Any = None
    ) -> None:
        # (the native step's finiteness is of the logits before the injection: checked anew)
        logits = logits.clone()  # the forward's output is an inference tensor: not writable here
        starts = np.concatenate([[0], np.cumsum(np.asarray(out.num_logits))])
        for r, row in enumerate(rows):
            if row is not None and row.prompt_token_ids == victim_prompt_ids and out.num_logits[r] > 0:
                seen["rows"] += 1
                if seen["rows"] >= at_step:
                    logits[int(starts[r]) : int(starts[r + 1])] = float("nan")
                    seen["injected"] += 1
        original(out, slots, rows, logits, result)

    victim_prompt_ids = llm.engine.tokenizer.encode(victim_prompt)
    runner._sample = sample  # type: ignore[method-assign]
    return lambda: seen["injected"]


def assert_nothing_held(llm: LLM) -> None:
    s = llm.engine.stats()
    assert s["num_requests_running"] == 0 and s["num_requests_waiting"] == 0
    assert s["kv_blocks_used"] == 0, s["kv_blocks_used"]
    assert s["mamba_slots_window"] == 0, s["mamba_slots_window"]
    assert s["checkpoints_pending"] == 0
    assert not llm.engine.requests
    assert len(llm.engine.runner.batch) == 0  # every request's sampling slot was freed


@pytest.mark.parametrize("at_step", [1, 4])  # in the prefill's sample, and mid-decode
def test_nan_logits_in_one_row_fail_that_request_alone(reference: list[list[int]], at_step: int) -> None:
    llm = make_llm()
    injected = inject_nan_logits(llm, PROMPTS[VICTIM], at_step)
    outs = llm.generate(PROMPTS, params())
    assert injected() >= 1
    victim = outs[VICTIM]
    assert victim.outputs[0].finish_reason == "error"
    assert victim.error is not None and "not finite" in victim.error
    assert len(victim.outputs[0].token_ids) == at_step - 1  # the tokens before the fault
    for i, r in enumerate(outs):
        if i != VICTIM:
            assert r.error is None and list(r.outputs[0].token_ids) == reference[i], i
    assert_nothing_held(llm)
    s = llm.engine.stats()
    assert s["kv_blocks_cached"] > 0 and s["checkpoints_committed"] > 0, "the cache was kept"

    # the cache serves the next requests as an engine that never saw the fault does: the same
    # hits for every prompt but the victim's (whose states were dropped), the same outputs
    llm.engine.runner._sample = type(llm.engine.runner)._sample.__get__(llm.engine.runner)  # type: ignore[method-assign]
    control = make_llm()
    first = control.generate(PROMPTS, params())
    # continuations of the finished sequences, which hit their last-token states
    follow_up = [p + r.outputs[0].text + " and then" for p, r in zip(PROMPTS, first)]
    again, expected = llm.generate(follow_up, params()), control.generate(follow_up, params())
    hits = [r.num_cached_tokens for r in again]
    want = [r.num_cached_tokens for r in expected]
    assert [h for i, h in enumerate(hits) if i != VICTIM] == [w for i, w in enumerate(want) if i != VICTIM]
    assert sum(hits) > 0
    assert [list(r.outputs[0].token_ids) for r in again] == [list(r.outputs[0].token_ids) for r in expected]
    assert_nothing_held(llm)


def test_a_sampling_error_in_one_row_fails_that_request_alone(reference: list[list[int]]) -> None:
    llm = make_llm()
    sampler = llm.engine.runner.sampler
    original = sampler.sample
    calls = {"batches_with_victim": 0}

    def sample(logits: torch.Tensor, rows: Any, **kw: Any) -> Any:
        if any(r.params.seed == VICTIM_SEED for r in rows):
            calls["batches_with_victim"] += 1
            raise ValueError("a bad sampling input")
        return original(logits, rows, **kw)

    sampler.sample = sample  # type: ignore[method-assign]
    outs = llm.generate(PROMPTS, params())
    assert calls["batches_with_victim"] >= 2  # the batch, then the victim's row alone
    assert outs[VICTIM].outputs[0].finish_reason == "error"
    assert outs[VICTIM].error is not None and "a bad sampling input" in outs[VICTIM].error
    for i, r in enumerate(outs):
        if i != VICTIM:
            assert list(r.outputs[0].token_ids) == reference[i], i
    assert_nothing_held(llm)


def test_a_state_written_by_a_failed_row_is_never_served() -> None:
    """The failed request's prompt states (checkpoints its prefill emitted) are dropped: the same
    prompt sent again computes its prefix anew instead of hitting a state of the failed row."""
    llm = make_llm()
    long_prompt = "A long and lonely prompt about lighthouses and their keepers. " * 12
    injected = inject_nan_logits(llm, long_prompt, 1)
    [out] = llm.generate([long_prompt], SamplingParams(max_tokens=4, temperature=0))
    assert injected() == 1 and out.outputs[0].finish_reason == "error"
    assert llm.engine.stats()["checkpoints_committed"] == 0
    llm.engine.runner._sample = type(llm.engine.runner)._sample.__get__(llm.engine.runner)  # type: ignore[method-assign]
    [again] = llm.generate([long_prompt], SamplingParams(max_tokens=4, temperature=0))
    assert again.outputs[0].finish_reason == "length"
    assert again.num_cached_tokens == 0
