"""The torch.compile'd Mamba2 mixer decode / verify (kernels/compiled.py, --compile-cpu-kernels)
against the eager twins it is built from, and through the engine against the eager engine."""

from __future__ import annotations

import math

import pytest
import torch

from hybridserve.engine.llm import LLM
from hybridserve.kernels import compiled
from hybridserve.kernels import reference as ref
from hybridserve.model.layers.norm import gated_rms_norm_torch as gated_rms_norm
from hybridserve.sampling.params import SamplingParams

NUM_SLOTS = 64  # more than R + the tokens of every case: distinct read and write slots


def _case(
    lengths: list[int], H: int, P: int, G: int, N: int, W: int, dtype: torch.dtype, bias: bool, seed: int
) -> dict:
    g = torch.Generator().manual_seed(seed)
    R, T, L = len(lengths), sum(lengths), max(lengths)
    d_inner = H * P
    conv_dim = d_inner + 2 * G * N

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    slots = torch.randperm(NUM_SLOTS - 1, generator=g)[: R + T] + 1  # never the null slot 0
    read = slots[:R]
    write = torch.zeros(R, L + 1, dtype=torch.int64)  # one spare column, as the engine's windows
    rest = iter(slots[R:].tolist())
    for r, n in enumerate(lengths):
        for t in range(n):
            write[r, t] = next(rest)
    if R > 1:
        write[0, 0] = read[1]  # a row writes the slot another row reads: reads must come first
    conv_state, ssm_state = rnd(NUM_SLOTS, conv_dim, W - 1), rnd(NUM_SLOTS, H, P, N)
    conv_state[0] = 0  # the null slot, zero as in the engine
    ssm_state[0] = 0
    qsl = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    return dict(
        qsl=qsl,
        xbc=rnd(T, conv_dim),
        dt=rnd(T, H),
        z=rnd(T, d_inner),
        conv_weight=rnd(conv_dim, W) * 0.5,
        conv_bias=rnd(conv_dim) if bias else None,
        conv_state=conv_state,
        A=-torch.rand(H, generator=g, dtype=torch.float64).to(dtype) * 4 - 0.5,
        D=rnd(H),
        dt_bias=rnd(H),
        ssm_state=ssm_state,
        norm_weight=rnd(d_inner),
        read_slot=read,
        write_slots=write,
    )


def _twins(c: dict, s: compiled.MixerShape) -> torch.Tensor:
    """The eager path of Mamba2Mixer for the same rows."""
    qsl, ws = c["qsl"], c["write_slots"]
    T = int(qsl[-1])
    conv = ref.causal_conv1d_update(
        c["xbc"], c["conv_weight"], c["conv_bias"], c["conv_state"], qsl, c["read_slot"], ws,
        "silu" if s.silu else None,
    )  # fmt: skip
    d_inner, gn = s.nheads * s.headdim, s.ngroups * s.dstate
    x, B, C = conv.split([d_inner, gn, gn], dim=-1)
    y = ref.selective_state_update(
        x.reshape(T, s.nheads, s.headdim), c["dt"], c["A"], B.reshape(T, s.ngroups, s.dstate),
        C.reshape(T, s.ngroups, s.dstate), c["D"], c["dt_bias"], c["ssm_state"], qsl, c["read_slot"], ws,
        s.dt_min, s.dt_max,
    )  # fmt: skip
    return gated_rms_norm(
        y.reshape(T, d_inner), c["z"], c["norm_weight"], s.norm_group_size, s.norm_eps, y.dtype
    )


def _compiled(c: dict, s: compiled.MixerShape) -> torch.Tensor:
    rows = compiled.padded_rows(c["qsl"], c["write_slots"], int(c["xbc"].shape[0]))
    assert rows is not None
    args = {k: v for k, v in c.items() if k not in ("qsl", "write_slots")}
    return compiled.mamba_mixer_rows(**args, rows=rows, shape=s)


CASES = [
    # (H, P, G, N, W, dtype, bias, dt_min, dt_max, row lengths of the batches run one after another)
    (
        8,
        32,
        2,
        16,
        4,
        torch.float32,
        True,
        0.0,
        math.inf,
        ([1], [1] * 5, [1] * 9, [3] * 4, [4, 1, 4, 2, 1, 4]),
    ),
    (6, 24, 1, 8, 3, torch.float64, False, 0.01, 0.05, ([1] * 3, [1] * 7, [4], [2, 2, 1, 2, 2])),
]


@pytest.mark.parametrize("H,P,G,N,W,dtype,bias,dt_min,dt_max,batches", CASES)
def test_mixer_rows_match_the_twins(H, P, G, N, W, dtype, bias, dt_min, dt_max, batches) -> None:
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    shape = compiled.MixerShape(H, P, G, N, H * P // G, 1e-5, dt_min, dt_max, True)
    for i, lengths in enumerate(batches):  # several batch sizes: the dynamic-batch graph is reused
        c = _case(lengths, H, P, G, N, W, dtype, bias, seed=10 * i + len(lengths))
        e = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in c.items()}
        want = _twins(e, shape)
        got = _compiled(c, shape)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        # every slot: the written ones hold the new states, all others (the null slot 0 too,
        # which the padding positions write zeros to) are untouched
        torch.testing.assert_close(c["ssm_state"], e["ssm_state"], rtol=tol, atol=tol)
        torch.testing.assert_close(c["conv_state"], e["conv_state"], rtol=0, atol=0)
        assert not c["ssm_state"][0].any() and not c["conv_state"][0].any()


def test_which_batches_take_the_compiled_path() -> None:
    plain = torch.tensor([0, 1, 2, 3])
    ws = torch.tensor([[4, 7], [5, 8], [6, 9]])
    rows = compiled.padded_rows(plain, ws, 3)
    assert rows is not None and rows.token_index is None and torch.equal(rows.write_slots, ws[:, :1])
    verify = compiled.padded_rows(torch.tensor([0, 2, 4, 6]), ws, 6)
    assert verify is not None and verify.token_index is None and torch.equal(verify.write_slots, ws)
    mixed = compiled.padded_rows(torch.tensor([0, 1, 3, 4]), ws, 4)  # lengths 1, 2, 1
    assert mixed is not None
    assert mixed.token_index.tolist() == [[0, 0], [1, 2], [3, 3]]
    assert mixed.valid.tolist() == [[True, False], [True, True], [True, False]]
    assert mixed.write_slots.tolist() == [[4, 0], [5, 8], [6, 0]]  # padding writes go to slot 0
    assert compiled.padded_rows(torch.tensor([0, 3, 6]), ws[:2], 6) is None  # 3 tokens, 2 slots
    assert compiled.padded_rows(plain, torch.tensor([[4], [0], [6]]), 3) is None  # a real token, null slot
    assert compiled.padded_rows(torch.tensor([0, 0, 2]), ws[:2], 2) is None  # an empty row
    assert compiled.padded_rows(torch.tensor([0]), ws[:0], 0) is None  # no rows


PROMPTS = ["The quick brown fox", "Once upon a time there was", "1 2 3 4 5 6 7 8", "hello hello hello"]


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_engine_outputs_identical_with_compiled_decode(spec, monkeypatch: pytest.MonkeyPatch) -> None:
    # With n-gram speculation most steps verify drafts (rows of 1 + k tokens): rows of equal
    # length take the compiled path, the others the eager twins.
    calls = {"n": 0}
    inner = compiled.mamba_mixer_rows

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls["n"] += 1
        return inner(*args, **kwargs)

    monkeypatch.setattr(compiled, "mamba_mixer_rows", counting)
    # the C++ kernels take precedence over the compiled graph where they are built
    monkeypatch.setenv("HYBRIDSERVE_NATIVE_CPU", "0")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float64", max_model_len=256, speculative_config=spec)
    eager = LLM("demo", **kw).generate(PROMPTS, params)
    assert calls["n"] == 0
    fast = LLM("demo", compile_cpu_kernels=True, **kw).generate(PROMPTS, params)
    assert calls["n"] > 0
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in eager]
