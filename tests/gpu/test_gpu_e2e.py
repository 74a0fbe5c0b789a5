"""End to end on the GPU: the demo model (float32) generates the same greedy tokens with the CUDA
ops and with the pure-torch twins, with and without speculative decoding and prefix caching."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from gpu_helpers import ON_GPU, cuda_demo_llm

pytestmark = pytest.mark.skipif(not ON_GPU, reason="end-to-end GPU test: needs a CUDA device")

MAX_TOKENS = 16


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, 780) for _ in range(150)]
    motif = [rng.randrange(3, 780) for _ in range(7)]
    return [
        shared + [rng.randrange(3, 780) for _ in range(21)],
        shared + [rng.randrange(3, 780) for _ in range(40)],
        [rng.randrange(3, 780) for _ in range(97)],
        (motif * 12)[:80],
        [rng.randrange(3, 780) for _ in range(5)],
    ]


def _generate(monkeypatch, kernels: str, **kw) -> tuple[list[list[int]], set[str]]:
    from hybridserve import SamplingParams

    monkeypatch.setenv("HYBRIDSERVE_KERNELS", kernels)
    llm = cuda_demo_llm(**kw)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True) as prof:
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params)
    names = {e.name for e in prof.events()}
    hs = {n for n in names if "hs::" in n}
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    del llm, outs
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, hs


def test_cuda_ops_equal_reference_ops(monkeypatch):
    ref_tokens, ref_kernels = _generate(monkeypatch, "reference")
    cuda_tokens, cuda_kernels = _generate(monkeypatch, "auto")
    assert not ref_kernels, f"HYBRIDSERVE_KERNELS=reference still ran CUDA kernels: {sorted(ref_kernels)[:5]}"
    assert any("ssd" in n or "chunk_scan" in n for n in cuda_kernels), sorted(cuda_kernels)
    assert any("ssu_kernel" in n for n in cuda_kernels), sorted(cuda_kernels)
    assert any("conv" in n for n in cuda_kernels), sorted(cuda_kernels)
    assert cuda_tokens == ref_tokens


@pytest.mark.parametrize("mode", ["align", "all"])
def test_ngram_speculation_is_lossless_on_cuda(monkeypatch, mode):
    plain, _ = _generate(monkeypatch, "auto", enable_prefix_caching=False)
    spec, kernels = _generate(
        monkeypatch,
        "auto",
        mamba_cache_mode=mode,
        mamba_block_size=64,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    )
    assert spec == plain
    assert kernels, "no hybridserve CUDA kernel ran"
