"""The prefix cache on the GPU: branch-point, grid and last-token checkpoints taken and hit by an
engine on a CUDA device give the same greedy tokens as prefix caching off on that device.

Two runs of each: float64 (the pure-torch twins on CUDA tensors: the engine's cache bookkeeping on
the device, where any difference is a bug) and float32 with the CUDA kernels (a branch point inside a
scan chunk is emitted by the SSD kernel splitting its chunk there, a last-token state is the one the
decode kernel wrote)."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from gpu_helpers import ON_GPU, cuda_demo_llm

pytestmark = pytest.mark.skipif(not ON_GPU, reason="prefix cache on the GPU: needs a CUDA device")

MAX_TOKENS = 16
MAMBA_BLOCK = 64


def _prompts() -> list[list[int]]:
    rng = random.Random(4321)
    shared = [rng.randrange(3, 780) for _ in range(150)]
    return [
        shared + [rng.randrange(3, 780) for _ in range(21)],  # prompts 0, 1 and 3 share 131..150 tokens
        shared + [rng.randrange(3, 780) for _ in range(40)],
        [rng.randrange(3, 780) for _ in range(97)],
        shared[:131],
    ]


def _next_turns(prompts: list[list[int]], outputs: list[list[int]]) -> list[list[int]]:
    rng = random.Random(99)
    return [
        p + o + [rng.randrange(3, 780) for _ in range(3 + i)]
        for i, (p, o) in enumerate(zip(prompts, outputs))
    ]


def _passes(
    dtype: str, **kw: object
) -> tuple[list[list[list[int]]], list[list[int]], dict[str, int], set[str]]:
    """The prompts, the same prompts again, then their next turns, one generate call each on one
    engine. Returns each pass's tokens, the hit lengths of passes 2 and 3, the engine's counters
    and the hybridserve CUDA kernels that ran."""
    from hybridserve import SamplingParams

    llm = cuda_demo_llm(dtype=dtype, max_num_batched_tokens=64, **kw)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = _prompts()
    tokens: list[list[list[int]]] = []
    hits: list[list[int]] = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True) as prof:
        for batch in (prompts, prompts, None):
            batch = _next_turns(prompts, tokens[0]) if batch is None else batch
            outs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
            tokens.append([list(o.outputs[0].token_ids) for o in outs])
            hits.append([o.num_cached_tokens for o in outs])
    kernels = {e.name for e in prof.events() if "hs::" in e.name}
    stats = dict(llm.engine.stats())
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, hits[1:], stats, kernels


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("mode", ["align", "all"])
def test_every_checkpoint_kind_is_hit_losslessly_on_cuda(mode: str, dtype: str) -> None:
    plain, _, _, _ = _passes(dtype, enable_prefix_caching=False)
    cached, (again, turns), stats, kernels = _passes(
        dtype, enable_prefix_caching=True, mamba_cache_mode=mode, mamba_block_size=MAMBA_BLOCK
    )
    for p, (got, want) in enumerate(zip(cached, plain)):
        assert got == want, f"pass {p + 1}: {got} != {want}"
    prompts = _prompts()
    # prompts 1 and 3 found prompt 0's KV without a state and kept one at their deepest cached
    # block (144 or 128), which the second pass hits
    assert all(again[i] in (128, 144) for i in (0, 1, 3)), again
    assert stats["prefix_hits_branch"] + stats["prefix_hits_grid"] >= 3, stats
    # every next turn resumes at the last token its first turn computed
    assert turns == [len(p) + MAX_TOKENS - 1 for p in prompts], turns
    assert stats["prefix_hits_last_token"] == len(prompts), stats
    if dtype == "float32":
        assert any("ssd" in n or "chunk_scan" in n for n in kernels), sorted(kernels)
        assert any("ssu_kernel" in n for n in kernels), sorted(kernels)
    else:  # the twins ran the model; only the slot copy (raw bytes, any dtype) is a CUDA kernel
        assert kernels and all("slot_copy" in n for n in kernels), sorted(kernels)
