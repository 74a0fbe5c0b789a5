"""`--kv-cache-dtype` (vLLM's flag; `kv_cache_dtype` of EngineArgs and LLM): the dtype the KV cache
is kept in, on rank 0 and on tensor-parallel workers, and the block size the pool is sized by.

A KV cache narrower than the model rounds K and V, so outputs may differ from the model dtype's;
what must not change is the promise that caching never changes an output. Every attention path
reads the rounded values (a whole prompt's own keys are rounded like the cache's), so with one
KV dtype the outputs are identical whatever the prefix hits, chunking, preemption and speculation.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
from test_engine_lossless import PREEMPTING, _llm, _prompts, mode_args

from hybridserve import LLM, SamplingParams
from hybridserve.distributed.executor import TPExecutor
from hybridserve.distributed.worker import ShardRunner
from hybridserve.errors import ConfigError
from hybridserve.model.demo import resolve_model_path

WANTED = {
    "auto": torch.float32,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def _kv_dtypes(llm: LLM) -> set[torch.dtype]:
    return {t.dtype for t in llm.engine.em.caches.kv.values()}


@pytest.mark.parametrize("name", list(WANTED))
def test_the_cache_and_its_sizing_take_the_flag_s_dtype(name: str) -> None:
    budget = 1 << 20  # 64 float32 blocks: enough for a 512-token sequence
    llm = LLM(
        "demo", dtype="float32", cpu_threads=1, kv_cache_dtype=name, kv_cache_memory=budget, max_model_len=512
    )
    want = WANTED[name]
    assert _kv_dtypes(llm) == {want}
    sizes = llm.engine.em.sizes
    width = torch.empty((), dtype=want).element_size()
    # the demo model: 2 attention layers of 2 KV heads x 32, K and V, 16-token blocks
    assert sizes.kv_bytes_per_block == 2 * 2 * 16 * 2 * 32 * width
    assert sizes.num_kv_blocks == budget // sizes.kv_bytes_per_block
    # the states are not the KV cache's business
    assert {t.dtype for t in llm.engine.em.caches.ssm.values()} == {torch.float32}
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=6, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 6


def test_an_unknown_dtype_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--kv-cache-dtype must be one of"):
        LLM("demo", kv_cache_dtype="fp8_inc")  # (vLLM's Intel Gaudi name; not served here)


def test_a_tensor_parallel_worker_keeps_its_kv_in_the_flag_s_dtype() -> None:
    for flag, want in (("auto", torch.float32), ("bfloat16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
        spec = TPExecutor.spec_for(
            str(resolve_model_path("demo")), torch.float32, torch.device("cpu"), 2, 8, 16, 8, "auto", flag
        )
        worker = ShardRunner(spec, rank=1)  # (its shard and caches; no process group is joined here)
        assert {t.dtype for t in worker.caches.kv.values()} == {want}


def test_rounding_changes_the_numbers_only_as_much_as_fp8_does() -> None:
    """The rounding is real (the logprobs move), and small (they move by little)."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    prompt = "Once upon a time there was a small village by the sea, and in it"

    def prompt_logprobs(name: str) -> list[float]:
        llm = LLM("demo", dtype="float64", cpu_threads=1, kv_cache_dtype=name)
        entries = llm.generate([prompt], params)[0].prompt_logprobs
        assert entries is not None
        return [next(iter(e.values())).logprob for e in entries[1:] if e]

    exact, fp8 = prompt_logprobs("auto"), prompt_logprobs("fp8")
    diffs = [abs(a - b) for a, b in zip(exact, fp8)]
    assert len(exact) == len(fp8) > 10
    assert max(diffs) > 1e-6
    assert max(diffs) < 0.5, diffs


# ---- losslessness with a KV cache narrower than the (float64) model
#
# The demo model's greedy tokens survive fp8 keys and values, so the tokens alone would not show
# a path that read unrounded ones: each generated token's logprob is compared too. Between the
# float64 cache and fp8 they differ by up to 1e-2 (bfloat16: 4e-4); between two runs with one KV
# dtype, only by the
# float64 rounding of a different batch (1e-12).

Run = tuple[tuple[tuple[int, ...], tuple[float, ...]], ...]
LOGPROBS = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=0)


def _run_logprobs(llm: LLM) -> Run:
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], LOGPROBS)
    runs = []
    for o in outs:
        c = o.outputs[0]
        assert c.logprobs is not None
        runs.append((tuple(c.token_ids), tuple(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs))))
    return tuple(runs)


@cache
def reference(kv: str) -> Run:
    """One request at a time, no prefix caching, whole prompts in one step, with this KV dtype."""
    llm = _llm(enable_prefix_caching=False, max_num_batched_tokens=1024, max_num_seqs=1, kv_cache_dtype=kv)
    return _run_logprobs(llm)


def _assert_reference(llm: LLM, kv: str) -> None:
    ref = reference(kv)
    for _ in range(2):  # the second pass hits the first one's checkpoints
        got = _run_logprobs(llm)
        for i, ((tokens, lps), (ref_tokens, ref_lps)) in enumerate(zip(got, ref, strict=True)):
            assert tokens == ref_tokens, f"prompt {i}: {tokens} != {ref_tokens}"
            assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-9, f"prompt {i}"


@pytest.mark.parametrize("kv", ["fp8", "bfloat16"])
@pytest.mark.parametrize("mode", ["align", "all"])
def test_prefix_hits_and_chunks_are_lossless_with_a_narrow_kv_cache(kv: str, mode: str) -> None:
    llm = _llm(**mode_args(mode), max_num_batched_tokens=64, kv_cache_dtype=kv)
    _assert_reference(llm, kv)
    stats = llm.engine.stats()
    assert stats["prefix_cache_hit_tokens"] > 0


def test_preemption_and_speculation_are_lossless_with_a_narrow_kv_cache() -> None:
    preempting = _llm(**mode_args("all"), **PREEMPTING, kv_cache_dtype="fp8")
    _assert_reference(preempting, "fp8")
    assert preempting.engine.stats()["num_preemptions_total"] > 0
    speculating = _llm(
        **mode_args("align"),
        max_num_batched_tokens=128,
        kv_cache_dtype="fp8",
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    )
    _assert_reference(speculating, "fp8")
    assert speculating.engine.stats()["spec_decode_draft_tokens"] > 0


@pytest.mark.parametrize("kv", ["fp8", "bfloat16"])
def test_the_narrow_cache_s_numbers_are_its_own(kv: str) -> None:
    """The tolerance above is far below what the narrow cache moves: a path reading unrounded keys
    would fail it."""
    gap = max(
        abs(a - b)
        for (_, lps), (_, exact) in zip(reference(kv), reference("auto"), strict=True)
        for a, b in zip(lps, exact)
    )
    assert gap > 1e-6, gap
