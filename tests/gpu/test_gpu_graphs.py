"""CUDA graphs of decode and verify steps (model/cuda_graphs.py) on the device: the demo model's
greedy tokens with the graphs replayed equal those of every step run eagerly (float32), with and
without n-gram speculation and prefix caching; in bfloat16 the graphs capture and replay too."""

from __future__ import annotations

import gc

import pytest
import torch
from gpu_helpers import ON_GPU, cuda_demo_llm

pytestmark = pytest.mark.skipif(not ON_GPU, reason="CUDA graphs: needs a CUDA device")

PROMPTS = [
    list(range(5, 5 + 150)) + [7, 9, 11],
    list(range(5, 5 + 150)) + [300, 301],
    [40, 41, 42, 43] * 20,
    [600 + i for i in range(97)],
    [3, 4, 5],
    [17] * 33,
]


def _run(**kw) -> tuple[list[list[int]], int, str | None]:
    from hybridserve import SamplingParams

    llm = cuda_demo_llm(**kw)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    graphs = llm.engine.runner.graphs
    replays = 0 if graphs is None else graphs.num_replays
    failed = None if graphs is None else graphs.failed
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    del llm, outs
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, replays, failed


@pytest.mark.parametrize(
    "kw",
    [
        {"enable_prefix_caching": False},
        {"enable_prefix_caching": True},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}},
    ],
    ids=["plain", "prefix_caching", "ngram"],
)
def test_graphs_give_the_eager_tokens(kw):
    eager, eager_replays, _ = _run(enforce_eager=True, **kw)
    graphed, replays, failed = _run(enforce_eager=False, **kw)
    assert eager_replays == 0
    assert failed is None, failed
    assert replays > 0
    assert graphed == eager


def test_graphs_capture_in_bfloat16():
    tokens, replays, failed = _run(enforce_eager=False, dtype="bfloat16")
    assert failed is None, failed
    assert replays > 0
    assert all(len(t) == 24 for t in tokens)
