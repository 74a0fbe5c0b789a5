"""causal_conv1d_prefill / causal_conv1d_update vs the float64 reference (DS conv-state layout)."""

from __future__ import annotations

import random

import pytest
import torch
from gpu_helpers import (
    DEVICE,
    ON_GPU,
    OUT_TOL,
    assert_close,
    gen,
    nan_pool,
    poison_allocator,
    qsl_of,
    randn,
    untouched_slots,
)

from hybridserve.kernels import dispatch as K
from hybridserve.kernels import reference as ref


def _out_tol(dtype, sdtype):
    """On the GPU the kernel accumulates in fp32; the CPU self-check runs the twin, which computes
    in promote(x, state) = bf16 for bf16 inputs: looser there."""
    if ON_GPU or torch.float32 in (dtype, sdtype):
        return OUT_TOL[dtype]
    return (6e-2, 6e-2)


STATE_EXACT = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (8e-3, 1e-6)}  # windows are copies of inputs


def _prefill_case(Dc, W, dtype, sdtype, lengths, g, bias=True):
    R = len(lengths)
    rng = random.Random(int(g.initial_seed()))
    init = [rng.random() < 0.6 for _ in range(R)]
    emits = [(r, t) for r in range(R) for t in range(lengths[r]) if rng.random() < 0.05]
    num_slots = 2 * R + len(emits) + 3
    perm = (torch.randperm(num_slots - 1, generator=g) + 1).tolist()
    read_slot = torch.tensor(perm[:R])
    write_slot = torch.tensor(perm[R : 2 * R])
    if R > 2:
        write_slot[0] = read_slot[0]
        write_slot[1] = 0
    pool = nan_pool((num_slots, Dc, W - 1), sdtype)
    for r in range(R):
        if init[r]:
            pool[read_slot[r]] = randn((Dc, W - 1), g, sdtype)
    T = sum(lengths)
    return dict(
        x=randn((T, Dc), g, dtype),
        w=randn((Dc, W), g, torch.float32, 0.5),
        b=randn((Dc,), g, torch.float32) if bias else None,
        pool=pool,
        qsl=qsl_of(lengths),
        read_slot=read_slot,
        his=torch.tensor(init),
        write_slot=write_slot,
        emit_row=torch.tensor([e[0] for e in emits], dtype=torch.int64),
        emit_token=torch.tensor([e[1] for e in emits], dtype=torch.int64),
        emit_slot=torch.tensor(perm[2 * R : 2 * R + len(emits)], dtype=torch.int64),
    )


def _prefill(fn, c, x, pool, cast, act="silu"):
    w = cast(c["w"])
    b = None if c["b"] is None else cast(c["b"])
    return fn(
        x,
        w,
        b,
        pool,
        c["qsl"],
        c["read_slot"],
        c["his"],
        c["write_slot"],
        c["emit_row"],
        c["emit_token"],
        c["emit_slot"],
        act,
    )


def _check_prefill(c, dtype, sdtype, act="silu"):
    pool = c["pool"].clone()
    poison_allocator()
    y = _prefill(K.causal_conv1d_prefill, c, c["x"], pool, lambda t: t, act)
    pool64 = c["pool"].double()
    y64 = _prefill(ref.causal_conv1d_prefill, c, c["x"].double(), pool64, lambda t: t.double(), act)
    assert y.dtype == dtype
    assert_close(y, y64, _out_tol(dtype, sdtype), what="y")
    lengths = (c["qsl"][1:] - c["qsl"][:-1]).tolist()
    written = {int(s) for s, n in zip(c["write_slot"].tolist(), lengths) if s != 0 and n > 0}
    written |= {int(s) for s in c["emit_slot"].tolist() if s != 0}
    if written:
        idx = torch.tensor(sorted(written), device=DEVICE)
        assert_close(pool[idx], pool64[idx], STATE_EXACT[sdtype], what="conv states")
    keep = untouched_slots(pool.shape[0], written)
    assert torch.equal(pool[keep].isnan(), c["pool"][keep].isnan())
    assert bool((pool[0] == 0).all())


@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize(
    "dtype,sdtype",
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.bfloat16, torch.float32)],
    ids=str,
)
def test_prefill_matches_float64_reference(W, dtype, sdtype):
    g = gen()
    lengths = [1, W - 1, 0, 37, 5, 130]
    _check_prefill(_prefill_case(200, W, dtype, sdtype, lengths, g), dtype, sdtype)


def test_prefill_wide_conv_dim_and_no_activation():
    g = gen()
    c = _prefill_case(10240 + 16, 4, torch.bfloat16, torch.bfloat16, [3, 20, 1], g, bias=False)
    _check_prefill(c, torch.bfloat16, torch.bfloat16)
    _check_prefill(c, torch.bfloat16, torch.bfloat16, act=None)


def test_prefill_strided_input():
    g = gen()
    c = _prefill_case(96, 4, torch.bfloat16, torch.bfloat16, [10, 2, 40], g)
    wide = randn((52, 96 + 64), g, torch.bfloat16)
    c["x"] = wide[:, 32 : 32 + 96]
    assert not c["x"].is_contiguous()
    _check_prefill(c, torch.bfloat16, torch.bfloat16)


def _update_case(Dc, W, dtype, sdtype, lengths, window, g):
    R = len(lengths)
    num_slots = R * window + 3
    perm = (torch.randperm(num_slots - 1, generator=g) + 1).tolist()
    windows = [perm[r * window : (r + 1) * window] for r in range(R)]
    rng = random.Random(int(g.initial_seed()))
    read_slot = torch.tensor([windows[r][rng.randint(0, window - 1)] for r in range(R)])
    ws = torch.zeros((R, window), dtype=torch.int64)
    for r in range(R):
        for t in range(lengths[r]):
            ws[r, t] = windows[r][t]
    pool = nan_pool((num_slots, Dc, W - 1), sdtype)
    for r in range(R):
        pool[read_slot[r]] = randn((Dc, W - 1), g, sdtype)
    return dict(
        x=randn((sum(lengths), Dc), g, dtype),
        w=randn((Dc, W), g, torch.float32, 0.5),
        b=randn((Dc,), g, torch.float32),
        pool=pool,
        qsl=qsl_of(lengths),
        read_slot=read_slot,
        ws=ws,
    )


def _check_update(c, dtype, sdtype):
    pool = c["pool"].clone()
    poison_allocator()
    y = K.causal_conv1d_update(c["x"], c["w"], c["b"], pool, c["qsl"], c["read_slot"], c["ws"], "silu")
    pool64 = c["pool"].double()
    y64 = ref.causal_conv1d_update(
        c["x"].double(), c["w"].double(), c["b"].double(), pool64, c["qsl"], c["read_slot"], c["ws"], "silu"
    )
    assert_close(y, y64, _out_tol(dtype, sdtype), what="y")
    written = sorted({int(s) for s in c["ws"].flatten().tolist() if s != 0})
    idx = torch.tensor(written, device=DEVICE)
    assert_close(pool[idx], pool64[idx], STATE_EXACT[sdtype], what="conv windows")
    keep = untouched_slots(pool.shape[0], set(written))
    assert torch.equal(pool[keep].isnan(), c["pool"][keep].isnan())
    assert torch.equal(pool[keep].nan_to_num(), c["pool"][keep].nan_to_num())


@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize(
    "dtype,sdtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)], ids=str
)
def test_update_matches_float64_reference(W, T, dtype, sdtype):
    g = gen()
    _check_update(_update_case(10240 + 16, W, dtype, sdtype, [T, T, 0, max(T - 1, 1)], 4, g), dtype, sdtype)


def test_update_rollback_after_partial_acceptance():
    """After a verify step of 4 tokens with a accepted, the next step reads window slot a - 1: the
    result equals a plain conv over the accepted tokens only."""
    g = gen()
    Dc, W = 64, 4
    for a in range(1, 5):
        c = _update_case(Dc, W, torch.float32, torch.float32, [4], 4, g)
        pool = c["pool"].clone()
        K.causal_conv1d_update(c["x"], c["w"], c["b"], pool, c["qsl"], c["read_slot"], c["ws"], "silu")
        nxt = randn((1, Dc), g, torch.float32)
        y_next = K.causal_conv1d_update(
            nxt,
            c["w"],
            c["b"],
            pool,
            qsl_of([1]),
            c["ws"][:, a - 1],
            torch.zeros((1, 1), dtype=torch.int64),
            "silu",
        )
        pool2 = c["pool"].clone()
        xs = torch.cat([c["x"][:a], nxt])
        y_seq = K.causal_conv1d_prefill(
            xs,
            c["w"],
            c["b"],
            pool2,
            qsl_of([a + 1]),
            c["read_slot"],
            torch.tensor([True]),
            torch.tensor([0]),
            torch.zeros(0, dtype=torch.int64),
            torch.zeros(0, dtype=torch.int64),
            torch.zeros(0, dtype=torch.int64),
        )
        assert_close(y_next, y_seq[-1:].double(), 1e-5, what=f"a={a}")


def test_emit_out_of_range_is_rejected():
    g = gen()
    c = _prefill_case(32, 4, torch.float32, torch.float32, [5], g)
    c["emit_row"] = torch.tensor([0])
    c["emit_token"] = torch.tensor([5])
    c["emit_slot"] = torch.tensor([1])
    with pytest.raises(ValueError):
        _prefill(K.causal_conv1d_prefill, c, c["x"], c["pool"].clone(), lambda t: t)
