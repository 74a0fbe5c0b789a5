"""The torch.compile'd Mamba2 mixer decode (kernels/compiled.py, --compile-cpu-kernels) against the
eager twins it is built from, and through the engine against the eager engine."""

from __future__ import annotations

import math

import pytest
import torch

from hybridserve.engine.llm import LLM
from hybridserve.kernels import compiled
from hybridserve.kernels import reference as ref
from hybridserve.model.layers.norm import gated_rms_norm
from hybridserve.sampling.params import SamplingParams

NUM_SLOTS = 24  # > 2 x the largest batch: distinct read and write slots


def _case(R: int, H: int, P: int, G: int, N: int, W: int, dtype: torch.dtype, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    d_inner = H * P
    conv_dim = d_inner + 2 * G * N

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    slots = torch.randperm(NUM_SLOTS - 1, generator=g)[: 2 * R] + 1  # never the null slot 0
    read, write = slots[:R], slots[R:].clone()
    if R > 1:
        write[0] = read[1]  # a row writes the slot another row reads: reads must come first
    return dict(
        xbc=rnd(R, conv_dim),
        dt=rnd(R, H),
        z=rnd(R, d_inner),
        conv_weight=rnd(conv_dim, W) * 0.5,
        conv_bias=rnd(conv_dim) if bias else None,
        conv_state=rnd(NUM_SLOTS, conv_dim, W - 1),
        A=-torch.rand(H, generator=g, dtype=torch.float64).to(dtype) * 4 - 0.5,
        D=rnd(H),
        dt_bias=rnd(H),
        ssm_state=rnd(NUM_SLOTS, H, P, N),
        norm_weight=rnd(d_inner),
        read_slot=read,
        write_slot=write,
    )


def _twins(c: dict, s: compiled.MixerShape) -> torch.Tensor:
    """The eager path of Mamba2Mixer for the same rows."""
    R = c["xbc"].shape[0]
    qsl = torch.arange(R + 1, dtype=torch.int64)
    ws = c["write_slot"][:, None]
    conv = ref.causal_conv1d_update(
        c["xbc"], c["conv_weight"], c["conv_bias"], c["conv_state"], qsl, c["read_slot"], ws,
        "silu" if s.silu else None,
    )  # fmt: skip
    d_inner, gn = s.nheads * s.headdim, s.ngroups * s.dstate
    x, B, C = conv.split([d_inner, gn, gn], dim=-1)
    y = ref.selective_state_update(
        x.reshape(R, s.nheads, s.headdim), c["dt"], c["A"], B.reshape(R, s.ngroups, s.dstate),
        C.reshape(R, s.ngroups, s.dstate), c["D"], c["dt_bias"], c["ssm_state"], qsl, c["read_slot"], ws,
        s.dt_min, s.dt_max,
    )  # fmt: skip
    return gated_rms_norm(
        y.reshape(R, d_inner), c["z"], c["norm_weight"], s.norm_group_size, s.norm_eps, y.dtype
    )


CASES = [
    # (H, P, G, N, W, dtype, bias, dt_min, dt_max, batch sizes run one after the other)
    (8, 32, 2, 16, 4, torch.float32, True, 0.0, math.inf, (1, 5, 9)),
    (6, 24, 1, 8, 3, torch.float64, False, 0.01, 0.05, (3, 7)),
]


@pytest.mark.parametrize("H,P,G,N,W,dtype,bias,dt_min,dt_max,batches", CASES)
def test_mixer_decode_matches_the_twins(H, P, G, N, W, dtype, bias, dt_min, dt_max, batches) -> None:
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    shape = compiled.MixerShape(H, P, G, N, H * P // G, 1e-5, dt_min, dt_max, True)
    for i, R in enumerate(batches):  # several batch sizes: the dynamic-batch graph is reused
        c = _case(R, H, P, G, N, W, dtype, bias, seed=10 * i + R)
        e = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in c.items()}
        want = _twins(e, shape)
        got = compiled.mamba_mixer_decode(**c, shape=shape)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        # every slot: the written ones hold the new states, all others are untouched
        torch.testing.assert_close(c["ssm_state"], e["ssm_state"], rtol=tol, atol=tol)
        torch.testing.assert_close(c["conv_state"], e["conv_state"], rtol=0, atol=0)


def test_only_plain_decode_batches_take_the_compiled_path() -> None:
    plain = torch.tensor([0, 1, 2, 3])
    ws = torch.tensor([[4, 0], [5, 0], [6, 0]])
    assert torch.equal(compiled.plain_decode_slots(plain, ws, 3), torch.tensor([4, 5, 6]))
    assert compiled.plain_decode_slots(torch.tensor([0, 1, 3]), ws[:2], 3) is None  # a verify row
    assert compiled.plain_decode_slots(plain, torch.tensor([[4], [0], [6]]), 3) is None  # null slot
    assert compiled.plain_decode_slots(torch.tensor([0]), ws[:0], 0) is None  # no rows


PROMPTS = ["The quick brown fox", "Once upon a time there was", "1 2 3 4 5 6 7 8", "hello hello hello"]


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_engine_outputs_identical_with_compiled_decode(spec, monkeypatch: pytest.MonkeyPatch) -> None:
    # With n-gram speculation nearly every step verifies drafts (rows of several tokens), which the
    # eager twins run; the outputs must be identical all the same.
    calls = {"n": 0}
    inner = compiled.mamba_mixer_decode

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls["n"] += 1
        return inner(*args, **kwargs)

    monkeypatch.setattr(compiled, "mamba_mixer_decode", counting)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float64", max_model_len=256, speculative_config=spec)
    eager = LLM("demo", **kw).generate(PROMPTS, params)
    assert calls["n"] == 0
    fast = LLM("demo", compile_cpu_kernels=True, **kw).generate(PROMPTS, params)
    assert calls["n"] > 0 or spec is not None
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in eager]
