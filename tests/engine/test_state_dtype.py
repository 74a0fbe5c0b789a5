"""`--mamba-ssm-cache-dtype` (vLLM's flag; `mamba_ssm_cache_dtype` of EngineArgs and LLM): the
dtype the Mamba states are kept in, on rank 0 and on tensor-parallel workers, and the slot size
the pool is sized by. "auto" is the checkpoint's field (float32 for the demo model), and a float64
model keeps float64 states whatever the flag says."""

from __future__ import annotations

import torch

from hybridserve import LLM, SamplingParams
from hybridserve.distributed.executor import TPExecutor
from hybridserve.distributed.worker import ShardRunner
from hybridserve.model.demo import resolve_model_path

PROMPTS = ["The capital of France is", "Once upon a time"]


def _states(llm: LLM) -> set[torch.dtype]:
    caches = llm.engine.em.caches
    return {t.dtype for t in (*caches.ssm.values(), *caches.conv.values())}


def test_the_states_take_the_flag_s_dtype_and_the_pool_its_slot_size() -> None:
    auto = LLM("demo", dtype="float32", cpu_threads=1)
    half = LLM("demo", dtype="float32", cpu_threads=1, mamba_ssm_cache_dtype="bfloat16")
    assert _states(auto) == {torch.float32} and _states(half) == {torch.bfloat16}
    assert half.engine.em.sizes.mamba_bytes_per_slot * 2 == auto.engine.em.sizes.mamba_bytes_per_slot
    # bfloat16 states round the recurrence, which on these prompts still picks the same tokens
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in auto.generate(PROMPTS, params)]
    assert [o.outputs[0].token_ids for o in half.generate(PROMPTS, params)] == want
    float64 = LLM("demo", dtype="float64", cpu_threads=1, mamba_ssm_cache_dtype="bfloat16")
    assert _states(float64) == {torch.float64}


def test_a_tensor_parallel_worker_keeps_its_states_in_the_flag_s_dtype() -> None:
    spec = TPExecutor.spec_for(
        resolve_model_path("demo"), torch.float32, torch.device("cpu"), 2, 8, 16, 8, "bfloat16"
    )
    worker = ShardRunner(spec, rank=1)  # (its shard and caches; no process group is joined here)
    assert {t.dtype for t in worker.caches.ssm.values()} == {torch.bfloat16}
