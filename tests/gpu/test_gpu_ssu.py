"""selective_state_update (decode / verify) vs the float64 reference."""

from __future__ import annotations

import math
import random

import pytest
import torch
from gpu_helpers import (
    DEVICE,
    ON_GPU,
    OUT_TOL,
    STATE_TOL,
    assert_close,
    f32,
    f64,
    gen,
    nan_pool,
    poison_allocator,
    qsl_of,
    randn,
    ssm_params,
    untouched_slots,
)

from hybridserve.kernels import dispatch as K
from hybridserve.kernels import reference as ref

SHAPES = [
    (8, 64, 128, 1),
    (128, 64, 128, 8),  # Nemotron-H-8B
    (48, 64, 128, 1),  # Granite-4.0-H-1B
    (24, 128, 256, 1),  # Falcon-H1
    (128, 80, 128, 8),  # P = 80
    (6, 32, 16, 2),  # tiny
    (4, 64, 96, 4),  # N = 96, not a power of two
]


def _case(H, P, N, G, dtype, lengths, window, g, dt_scale=1.0):
    """Inputs of one call: R rows with `lengths` tokens, a state window of `window` slots per row
    (random permutation of a larger pool), read slot = window[a_prev - 1]."""
    R = len(lengths)
    T = sum(lengths)
    num_slots = R * window + 5
    perm = (torch.randperm(num_slots - 1, generator=g) + 1).tolist()
    windows = [perm[r * window : (r + 1) * window] for r in range(R)]
    a_prev = [random.Random(int(g.initial_seed()) + r).randint(1, window) for r in range(R)]
    read_slot = torch.tensor([windows[r][a_prev[r] - 1] for r in range(R)], dtype=torch.int64)
    ws = torch.zeros((R, window), dtype=torch.int64)
    for r in range(R):
        for t in range(lengths[r]):
            ws[r, t] = windows[r][t]
    pool = nan_pool((num_slots, H, P, N))
    for r in range(R):
        pool[read_slot[r]] = randn((H, P, N), g, torch.float32, 0.5)
    x = randn((T, H, P), g, dtype)
    dt = randn((T, H), g, dtype, dt_scale)
    B = randn((T, G, N), g, dtype, 0.5)
    C = randn((T, G, N), g, dtype, 0.5)
    A, D, dt_bias = ssm_params(H, g)
    return dict(
        x=x,
        dt=dt,
        A=A,
        B=B,
        C=C,
        D=D,
        dt_bias=dt_bias,
        pool=pool,
        qsl=qsl_of(lengths),
        read_slot=read_slot,
        ws=ws,
    )


def _run(fn, c, pool, cast, dt_min=0.0, dt_max=math.inf):
    x, dt, B, C = cast(c["x"], c["dt"], c["B"], c["C"])
    A, D, dt_bias = cast(c["A"], c["D"], c["dt_bias"])
    y = fn(x, dt, A, B, C, D, dt_bias, pool, c["qsl"], c["read_slot"], c["ws"], dt_min, dt_max)
    return y


def _check(c, dtype, dt_min=0.0, dt_max=math.inf):
    pool = c["pool"].clone()
    poison_allocator()
    y = _run(K.selective_state_update, c, pool, lambda *t: list(t), dt_min, dt_max)
    pool64 = c["pool"].double()
    y64 = _run(ref.selective_state_update, c, pool64, f64, dt_min, dt_max)
    pool32 = c["pool"].clone()
    y32 = _run(ref.selective_state_update, c, pool32, f32, dt_min, dt_max)
    assert y.dtype == dtype and y.shape == c["x"].shape
    assert_close(y, y64, OUT_TOL[dtype], y32, "y")
    written = sorted({int(s) for s in c["ws"].flatten().tolist() if s != 0})
    idx = torch.tensor(written, dtype=torch.int64, device=DEVICE)
    assert_close(pool[idx], pool64[idx], STATE_TOL[dtype], pool32[idx], "states")
    # slots that nobody writes keep their exact bits (NaN poison, the read slots' values, slot 0)
    keep = untouched_slots(pool.shape[0], set(written))
    assert torch.equal(pool[keep].isnan(), c["pool"][keep].isnan())
    assert torch.equal(torch.nan_to_num(pool[keep]), torch.nan_to_num(c["pool"][keep]))
    assert bool((pool[0] == 0).all())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_matches_float64_reference(shape, dtype):
    H, P, N, G = shape
    g = gen()
    lengths = [1, 6, 3, 4, 1, 2]
    c = _case(H, P, N, G, dtype, lengths, 6, g)
    _check(c, dtype)


@pytest.mark.parametrize("T", [1, 2, 4, 6])
def test_uniform_T_and_zero_length_rows(T):
    g = gen()
    c = _case(8, 64, 128, 2, torch.bfloat16, [T, 0, T, T, 0], 6, g)
    _check(c, torch.bfloat16)


def test_null_write_entries_are_skipped():
    g = gen()
    c = _case(8, 64, 128, 1, torch.float32, [5, 3, 6], 6, g)
    c["ws"][0, 1] = 0
    c["ws"][2, 0] = 0
    c["ws"][2, 5] = 0
    _check(c, torch.float32)


def test_dt_extremes_and_limits():
    g = gen()
    c = _case(6, 32, 16, 2, torch.float32, [4, 6, 2], 6, g)
    dt = c["dt"].clone()
    dt[0, 0] = 30.0  # threshold branch of softplus
    dt[1, 1] = -30.0  # dt -> 0, decay 1
    dt[2, :] = 40.0
    c["dt"] = dt
    c["A"] = c["A"].clone()
    c["A"][3] = -200.0  # A * dt << -100: the decay underflows to 0, no NaN
    _check(c, torch.float32)
    _check(c, torch.float32, dt_min=0.02, dt_max=0.1)


def test_multi_token_equals_token_by_token():
    """A verify row of T tokens == T single-token decodes chained through the window slots (same
    arithmetic: bit-exact on the GPU)."""
    g = gen()
    H, P, N, G = 16, 64, 128, 4
    T = 5
    c = _case(H, P, N, G, torch.bfloat16, [T], T, g)
    pool_a = c["pool"].clone()
    ya = K.selective_state_update(
        c["x"],
        c["dt"],
        c["A"],
        c["B"],
        c["C"],
        c["D"],
        c["dt_bias"],
        pool_a,
        c["qsl"],
        c["read_slot"],
        c["ws"],
    )
    pool_b = c["pool"].clone()
    read = c["read_slot"].clone()
    ys = []
    for t in range(T):
        sl = slice(t, t + 1)
        ws = c["ws"][:, t : t + 1].clone()
        ys.append(
            K.selective_state_update(
                c["x"][sl],
                c["dt"][sl],
                c["A"],
                c["B"][sl],
                c["C"][sl],
                c["D"],
                c["dt_bias"],
                pool_b,
                qsl_of([1]),
                read,
                ws,
            )
        )
        read = ws[:, 0].clone()
    yb = torch.cat(ys)
    slots = c["ws"][0].to(DEVICE)
    if ON_GPU:
        assert torch.equal(ya, yb)
        assert torch.equal(pool_a[slots], pool_b[slots])
    else:
        assert_close(ya, yb.double(), 1e-2)
        assert_close(pool_a[slots], pool_b[slots].double(), 1e-5)


def test_deterministic():
    g = gen()
    c = _case(128, 64, 128, 8, torch.bfloat16, [6] * 8, 6, g)
    p1, p2 = c["pool"].clone(), c["pool"].clone()
    args = (c["x"], c["dt"], c["A"], c["B"], c["C"], c["D"], c["dt_bias"])
    y1 = K.selective_state_update(*args, p1, c["qsl"], c["read_slot"], c["ws"])
    y2 = K.selective_state_update(*args, p2, c["qsl"], c["read_slot"], c["ws"])
    assert torch.equal(y1, y2)
    assert torch.equal(p1.nan_to_num(), p2.nan_to_num())


def test_strided_views_and_gpu_index_tensors():
    """x / B / C / dt as views into one projection output (row stride = full width), and index
    tensors already on the device (no host sync path)."""
    g = gen()
    H, P, N, G = 8, 64, 128, 2
    lengths = [3, 1, 6]
    c = _case(H, P, N, G, torch.bfloat16, lengths, 6, g)
    T = sum(lengths)
    wide = randn((T, H * P + 2 * G * N + H + 7), g, torch.bfloat16)
    x = wide[:, : H * P].view(T, H, P)
    B = wide[:, H * P : H * P + G * N].view(T, G, N)
    C = wide[:, H * P + G * N : H * P + 2 * G * N].view(T, G, N)
    dt = wide[:, H * P + 2 * G * N : H * P + 2 * G * N + H]
    assert not x.is_contiguous()
    c.update(x=x, B=B, C=C, dt=dt)
    c["qsl"] = c["qsl"].to(DEVICE)
    c["read_slot"] = c["read_slot"].to(DEVICE)
    c["ws"] = c["ws"].to(DEVICE)
    _check(c, torch.bfloat16)


def test_too_many_tokens_for_the_window_is_rejected():
    g = gen()
    c = _case(6, 32, 16, 2, torch.float32, [3], 3, g)
    ws = c["ws"][:, :2].clone()
    with pytest.raises(ValueError):
        K.selective_state_update(
            c["x"],
            c["dt"],
            c["A"],
            c["B"],
            c["C"],
            c["D"],
            c["dt_bias"],
            c["pool"],
            c["qsl"],
            c["read_slot"],
            ws,
        )


def test_float32_dt_with_bf16_activations():
    g = gen()
    c = _case(8, 64, 128, 2, torch.bfloat16, [2, 5, 1], 6, g)
    c["dt"] = randn(tuple(c["dt"].shape), g, torch.float32)
    _check(c, torch.bfloat16)
