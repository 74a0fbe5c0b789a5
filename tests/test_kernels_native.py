"""The C++ CPU kernels (kernels/native.py) against plain float64 loops, and the engine with them
on and off."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from hybridserve.kernels import native

torch.set_num_threads(1)

pytestmark = pytest.mark.skipif(
    not native.enabled(), reason="HYBRIDSERVE_NATIVE_CPU=0 turns the native kernels off"
)


def test_the_library_builds_here():
    # CI runs on a machine with g++: the kernels must not silently fall back to torch there
    assert native.library() is not None


def attention_ref(q, kv, block_table, qsl, positions, scale):
    """Token by token, key by key, in float64."""
    T, H, D = q.shape
    bs, KVH = kv.shape[2], kv.shape[3]
    out = torch.zeros(T, H, D, dtype=torch.float64)
    for r in range(len(qsl) - 1):
        for t in range(int(qsl[r]), int(qsl[r + 1])):
            n = int(positions[t]) + 1
            for h in range(H):
                g = h // (H // KVH)
                scores = []
                for j in range(n):
                    b, o = int(block_table[r, j // bs]), j % bs
                    scores.append(scale * float(q[t, h].double() @ kv[b, 0, o, g].double()))
                m = max(scores)
                w = [math.exp(s - m) for s in scores]
                z = sum(w)
                for j in range(n):
                    b, o = int(block_table[r, j // bs]), j % bs
                    out[t, h] += (w[j] / z) * kv[b, 1, o, g].double()
    return out


def make_case(row_tokens, contexts, H, KVH, D, bs, dtype, seed=0):
    """Rows with row_tokens[r] query tokens whose last one sits at position contexts[r] - 1,
    blocks scattered over a pool bigger than needed."""
    g = torch.Generator().manual_seed(seed)
    R = len(row_tokens)
    max_blocks = max((c + bs - 1) // bs for c in contexts) + 1
    num_blocks = R * max_blocks + 3
    kv = torch.randn(num_blocks, 2, bs, KVH, D, generator=g, dtype=torch.float64).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)[: R * max_blocks]
    block_table = perm.view(R, max_blocks).clone()
    qsl = torch.tensor([0, *torch.tensor(row_tokens).cumsum(0).tolist()], dtype=torch.int64)
    positions = torch.cat(
        [torch.arange(c - n, c, dtype=torch.int64) for n, c in zip(row_tokens, contexts, strict=True)]
    )
    q = torch.randn(int(qsl[-1]), H, D, generator=g, dtype=torch.float64).to(dtype)
    return q, kv, block_table, qsl, positions


@pytest.mark.parametrize(
    "H, KVH, D, bs",
    [(4, 2, 32, 16), (4, 4, 64, 8), (6, 2, 24, 5), (8, 1, 128, 16), (3, 3, 7, 4)],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_paged_attention_matches_loops(H, KVH, D, bs, dtype):
    # decode rows (1 token), verify rows (1 + k tokens), a row of one key, one crossing blocks
    row_tokens = [1, 4, 1, 3, 1]
    contexts = [1, 37, 2 * bs, 9, 3 * bs + 1]
    q, kv, bt, qsl, pos = make_case(row_tokens, contexts, H, KVH, D, bs, dtype)
    scale = D**-0.5
    out = native.paged_attention(q, kv, bt, qsl, pos, scale)
    assert out is not None and out.dtype == dtype and out.shape == q.shape
    ref = attention_ref(q, kv, bt, qsl, pos, scale)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_a_token_gets_the_same_output_alone_and_among_drafts():
    # a verify row's first token is exactly what a decode of that token alone computes
    q, kv, bt, qsl, pos = make_case([4], [50], 4, 2, 32, 16, torch.float32)
    together = native.paged_attention(q, kv, bt, qsl, pos, 0.2)
    for i in range(4):
        alone = native.paged_attention(q[i : i + 1], kv, bt, qsl.new_tensor([0, 1]), pos[i : i + 1], 0.2)
        assert torch.equal(alone[0], together[i])


def test_the_engine_attention_layer_uses_it_and_agrees_with_sdpa(monkeypatch):
    from hybridserve.engine.llm import LLM
    from hybridserve.sampling.params import SamplingParams

    calls = []
    real = native.paged_attention

    def counting(*a, **kw):
        res = real(*a, **kw)
        calls.append(res is not None)
        return res

    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 250 + 3 for j in range(20 + 9 * i)]} for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm = LLM("demo", dtype="float64", max_num_seqs=8)
    monkeypatch.setattr(native, "paged_attention", counting)
    with_native = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert calls and all(calls)
    monkeypatch.setattr(native, "paged_attention", lambda *a, **kw: None)  # the SDPA path
    with_sdpa = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert with_native == with_sdpa


@pytest.mark.parametrize(
    "what", ["block out of range", "negative block", "negative position", "table too short"]
)
def test_bad_tables_are_refused_before_reading(what):
    q, kv, bt, qsl, pos = make_case([1, 2], [20, 30], 4, 2, 32, 16, torch.float32)
    if what == "block out of range":
        bt[1, 1] = kv.shape[0]
    elif what == "negative block":
        bt[0, 0] = -1
    elif what == "negative position":
        pos[1] = -1
    else:
        bt = bt[:, :1].contiguous()  # row 1 needs 2 blocks
    with pytest.raises(ValueError, match="outside the cache|negative"):
        native.paged_attention(q, kv, bt, qsl, pos, 0.1)


def test_shapes_that_do_not_fit_are_refused_or_declined():
    q, kv, bt, qsl, pos = make_case([1, 1], [5, 6], 4, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="qsl ends at"):
        native.paged_attention(q[:1], kv, bt, qsl, pos, 0.1)
    with pytest.raises(ValueError, match="rows but a block table"):
        native.paged_attention(q, kv, bt[:1], qsl, pos, 0.1)
    # not its dtype or layout: None, and the caller keeps its torch path
    assert native.paged_attention(q.bfloat16(), kv.bfloat16(), bt, qsl, pos, 0.1) is None
    assert native.paged_attention(q, kv.double(), bt, qsl, pos, 0.1) is None
    assert native.paged_attention(q[:, :3], kv, bt, qsl, pos, 0.1) is None  # H not a multiple of KVH


def test_no_compiler_means_the_torch_path(tmp_path):
    code = (
        "import logging; logging.basicConfig()\n"
        "from hybridserve.kernels import native\n"
        "assert native.library() is None\n"
        "print('fallback ok')\n"
    )
    env = {**os.environ, "CXX": "/bin/false", "HYBRIDSERVE_CACHE_DIR": str(tmp_path)}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "fallback ok" in res.stdout and "native CPU kernels unavailable" in res.stderr
    # and a build in a fresh cache folder works and is reused
    env["CXX"] = "g++"
    code_ok = "from hybridserve.kernels import native\nassert native.library() is not None\n"
    for _ in range(2):
        res = subprocess.run(
            [sys.executable, "-c", code_ok], env=env, capture_output=True, text=True, timeout=300
        )
        assert res.returncode == 0, res.stderr
    assert len(list((tmp_path / "cpu_kernels").glob("*/libhybridserve_cpu.so"))) == 1
