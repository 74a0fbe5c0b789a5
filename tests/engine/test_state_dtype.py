"""`--mamba-ssm-cache-dtype` (vLLM's flag; `mamba_ssm_cache_dtype` of EngineArgs and LLM): the
dtype the Mamba states are kept in, on rank 0 and on tensor-parallel workers, and the slot size
the pool is sized by. "auto" is the checkpoint's field (float32 for the demo model), "float32"
holds over a checkpoint that asks for bfloat16, and a float64 model keeps float64 states."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.distributed.executor import TPExecutor
from hybridserve.distributed.worker import ShardRunner
from hybridserve.errors import ConfigError
from hybridserve.model.demo import resolve_model_path

PROMPTS = ["The capital of France is", "Once upon a time"]


@pytest.fixture(scope="module")
def bf16_states_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The demo checkpoint with `"mamba_ssm_cache_dtype": "bfloat16"` in its config.json."""
    d = tmp_path_factory.mktemp("bf16_states") / "demo"
    shutil.copytree(resolve_model_path("demo"), d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "mamba_ssm_cache_dtype": "bfloat16"}))
    return str(d)


def _states(llm: LLM) -> set[torch.dtype]:
    caches = llm.engine.em.caches
    return {t.dtype for t in (*caches.ssm.values(), *caches.conv.values())}


def test_float32_holds_over_a_checkpoint_that_asks_for_bfloat16(bf16_states_checkpoint: str) -> None:
    auto = LLM(bf16_states_checkpoint, dtype="float32", cpu_threads=1)
    full = LLM(bf16_states_checkpoint, dtype="float32", cpu_threads=1, mamba_ssm_cache_dtype="float32")
    assert _states(auto) == {torch.bfloat16} and _states(full) == {torch.float32}
    assert auto.engine.em.sizes.mamba_bytes_per_slot * 2 == full.engine.em.sizes.mamba_bytes_per_slot
    # float32 states give the demo model's own tokens (its checkpoint asks for float32 states)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    demo = LLM("demo", dtype="float32", cpu_threads=1)
    assert _states(demo) == {torch.float32}
    want = [o.outputs[0].token_ids for o in demo.generate(PROMPTS, params)]
    assert [o.outputs[0].token_ids for o in full.generate(PROMPTS, params)] == want
    float64 = LLM(bf16_states_checkpoint, dtype="float64", cpu_threads=1)
    assert _states(float64) == {torch.float64}
    with pytest.raises(ConfigError, match="--mamba-ssm-cache-dtype"):
        LLM("demo", mamba_ssm_cache_dtype="bfloat16")  # (vLLM's; not served here)


def test_a_tensor_parallel_worker_keeps_its_states_in_the_flag_s_dtype(bf16_states_checkpoint: str) -> None:
    for flag, want in (("auto", torch.bfloat16), ("float32", torch.float32)):
        spec = TPExecutor.spec_for(
            bf16_states_checkpoint, torch.float32, torch.device("cpu"), 2, 8, 16, 8, flag
        )
        worker = ShardRunner(spec, rank=1)  # (its shard and caches; no process group is joined here)
        assert {t.dtype for t in worker.caches.ssm.values()} == {want}
