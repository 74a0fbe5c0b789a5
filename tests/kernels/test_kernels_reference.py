"""The reference kernels against a plain float64 token-by-token recurrence (docs/kernel-design.md,
"Testing and tolerances")."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hybridserve.kernels import reference as K

torch.set_num_threads(1)  # 2 threads on 2 shared, busy cores is several times slower


# ------------------------------------------------------------------------------------------------
# plain float64 oracles: python loops over tokens, obviously correct
# ------------------------------------------------------------------------------------------------


def softplus_ref(v: float) -> float:
    return v if v > 20.0 else math.log1p(math.exp(v))


def ssm_seq_ref(x, dt, A, B, C, D, dt_bias, h0, dt_min=0.0, dt_max=math.inf):
    """One row. x [L,H,P], dt [L,H], B/C [L,G,N], h0 [H,P,N]. Returns y [L,H,P], states [L,H,P,N]."""
    L, H, P = x.shape
    G = B.shape[1]
    hpg = H // G
    h = h0.clone().double()
    ys, hs = [], []
    for t in range(L):
        y_t = torch.zeros(H, P, dtype=torch.float64)
        for hd in range(H):
            g = hd // hpg
            d = softplus_ref(float(dt[t, hd]) + float(dt_bias[hd]))
            d = min(max(d, dt_min), dt_max)
            a = math.exp(d * float(A[hd]))
            h[hd] = a * h[hd] + d * torch.outer(x[t, hd].double(), B[t, g].double())
            y_t[hd] = h[hd] @ C[t, g].double() + float(D[hd]) * x[t, hd].double()
        ys.append(y_t)
        hs.append(h.clone())
    return torch.stack(ys), torch.stack(hs)


def conv_seq_ref(x, w, b, s0, act=True):
    """One row. x [L,Dc], w [Dc,W], s0 [Dc,W-1]. Returns y [L,Dc], states after each token [L,Dc,W-1]."""
    L, Dc = x.shape
    W = w.shape[1]
    cols = [s0[:, i].double() for i in range(W - 1)]
    ys, ss = [], []
    for t in range(L):
        cols.append(x[t].double())
        win = torch.stack(cols[-W:], dim=1)  # [Dc, W]
        y = (win * w.double()).sum(1) + (b.double() if b is not None else 0.0)
        ys.append(F.silu(y) if act else y)
        ss.append(torch.stack(cols[len(cols) - (W - 1) :], dim=1) if W > 1 else torch.zeros(Dc, 0))
    return torch.stack(ys), torch.stack(ss)


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def make_ssm_params(H, P, N, G, T, gen, dtype=torch.float64):
    x = torch.randn(T, H, P, generator=gen, dtype=dtype)
    dt = torch.randn(T, H, generator=gen, dtype=dtype)
    A = -(torch.rand(H, generator=gen, dtype=dtype) + 1.0)
    B = torch.randn(T, G, N, generator=gen, dtype=dtype) / 2
    C = torch.randn(T, G, N, generator=gen, dtype=dtype) / 2
    D = torch.randn(H, generator=gen, dtype=dtype)
    dt_bias = torch.rand(H, generator=gen, dtype=dtype) - 3.0
    return x, dt, A, B, C, D, dt_bias


def qsl_of(lengths):
    q = [0]
    for n in lengths:
        q.append(q[-1] + n)
    return torch.tensor(q, dtype=torch.int64)


def i64(v):
    return torch.tensor(v, dtype=torch.int64)


SSD_CASES = [
    # (H, P, N, G, Q, lengths, num_computed, has_init)
    (4, 8, 16, 1, 8, [1], [0], [False]),
    (4, 8, 16, 2, 8, [8], [0], [False]),
    (6, 5, 7, 3, 8, [21], [0], [False]),
    (6, 5, 7, 3, 8, [21], [5], [True]),
    (4, 6, 8, 2, 4, [3, 17, 1, 9], [0, 6, 3, 8], [False, True, True, False]),
    (8, 3, 4, 8, 16, [40, 2], [13, 31], [True, True]),
    (4, 4, 4, 1, 8, [0, 5, 0], [0, 2, 0], [False, True, False]),
    # every row on chunk boundaries: the packed layout is used as the chunk layout (no padding)
    (4, 6, 8, 2, 4, [8, 4, 12], [0, 4, 8], [False, True, True]),
]


@pytest.fixture(params=["one_group", "chunk_groups"])
def decay_budget(request, monkeypatch):
    if request.param == "chunk_groups":  # force the chunk-group loop (one chunk per group)
        monkeypatch.setattr(K, "SSD_DECAY_BUDGET_BYTES", 1)
    return request.param


@pytest.mark.parametrize("case", SSD_CASES)
@pytest.mark.parametrize("limits", [(0.0, math.inf), (0.02, 0.3)])
def test_ssd_prefill_matches_sequential(case, limits, decay_budget):
    H, P, N, G, Q, lengths, ncomp, his = case
    gen = torch.Generator().manual_seed(torch.seed() % (2**31))
    T = sum(lengths)
    R = len(lengths)
    x, dt, A, B, C, D, dt_bias = make_ssm_params(H, P, N, G, T, gen)
    num_slots = 2 * R + 8
    state = torch.randn(num_slots, H, P, N, generator=gen, dtype=torch.float64)
    state[0] = 0
    read = i64([1 + r for r in range(R)])
    write = i64([R + 1 + r for r in range(R)])
    qsl = qsl_of(lengths)
    # emits: every chunk end inside each row (not the last token), into fresh slots
    er, et, es = [], [], []
    nxt = 2 * R + 1
    for r, (n, c) in enumerate(zip(lengths, ncomp)):
        for t in range(n - 1):
            if (c + t + 1) % Q == 0 and nxt < num_slots:
                er.append(r)
                et.append(t)
                es.append(nxt)
                nxt += 1
    before = state.clone()
    y = K.ssd_prefill(
        x, dt, A, B, C, D, dt_bias, state, qsl, i64(ncomp), read, torch.tensor(his), write,
        i64(er), i64(et), i64(es), Q, *limits,
    )  # fmt: skip
    for r in range(R):
        s, e = int(qsl[r]), int(qsl[r + 1])
        h0 = before[int(read[r])] if his[r] else torch.zeros(H, P, N, dtype=torch.float64)
        if e == s:
            continue
        yr, hs = ssm_seq_ref(x[s:e], dt[s:e], A, B[s:e], C[s:e], D, dt_bias, h0, *limits)
        torch.testing.assert_close(y[s:e], yr, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(state[int(write[r])], hs[-1], rtol=1e-10, atol=1e-10)
        for row, tok, slot in zip(er, et, es):
            if row == r:
                torch.testing.assert_close(state[slot], hs[tok], rtol=1e-10, atol=1e-10)
    # untouched slots stay bit-exact, incl. the read slots and the null slot
    touched = set(write.tolist()) | set(es)
    for sl in range(num_slots):
        if sl not in touched:
            assert torch.equal(state[sl], before[sl]), sl
        elif sl in write.tolist() and lengths[write.tolist().index(sl)] == 0:
            assert torch.equal(state[sl], before[sl])


def test_ssd_prefill_read_slot_equals_write_slot_and_null_write():
    gen = torch.Generator().manual_seed(1)
    H, P, N, G, Q = 4, 4, 8, 2, 4
    x, dt, A, B, C, D, dt_bias = make_ssm_params(H, P, N, G, 10, gen)
    state = torch.randn(4, H, P, N, generator=gen, dtype=torch.float64)
    state[0] = 0
    before = state.clone()
    qsl = i64([0, 6, 10])
    y = K.ssd_prefill(
        x, dt, A, B, C, D, dt_bias, state, qsl, i64([3, 0]), i64([2, 0]), torch.tensor([True, False]),
        i64([2, 0]), i64([]), i64([]), i64([]), Q,
    )  # fmt: skip
    yr, hs = ssm_seq_ref(x[:6], dt[:6], A, B[:6], C[:6], D, dt_bias, before[2])
    torch.testing.assert_close(y[:6], yr, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state[2], hs[-1], rtol=1e-10, atol=1e-10)
    assert torch.equal(state[0], before[0])  # null write skipped
    assert torch.equal(state[1], before[1]) and torch.equal(state[3], before[3])


def states_seq(x, dt, A, B, dt_bias, h0, dt_min=0.0, dt_max=math.inf):
    """One row, token by token in float64, dt through the twin's own pipeline (process_dt).
    Returns the state after each token [L, H, P, N]."""
    L, H, P = x.shape
    hpg = H // B.shape[1]
    d = K.process_dt(dt.double(), dt_bias.double(), dt_min, dt_max)  # [L, H]
    h = h0.clone().double()
    out = []
    for t in range(L):
        Bt = B[t].double().repeat_interleave(hpg, dim=0)  # [H, N]: head h uses group h // hpg
        dx = d[t][:, None] * x[t].double()  # [H, P]
        h = torch.exp(d[t] * A.double())[:, None, None] * h + dx[:, :, None] * Bt[:, None, :]
        out.append(h)
    return torch.stack(out)


EMIT_ANY_CASES = [
    # (H, P, N, G, Q, lengths, num_computed, has_init, emit tokens per row)
    # one row from 0: the first token, inside chunks, a chunk end, the last token
    (4, 3, 5, 2, 8, [21], [0], [False], [[0, 3, 7, 12, 13, 20]]),
    # rows starting mid-chunk (short first chunk with leading padding), one-token rows, G > 1
    (6, 4, 6, 3, 8, [19, 1, 1, 11, 6], [5, 0, 13, 8, 30], [True, False, True, True, True],
     [[0, 1, 2, 3, 9, 17, 18], [0], [0], [0, 4, 7, 10], [0, 1, 5]]),
    # several emits at one token (to different slots), every token of a row, G = H
    (4, 2, 3, 4, 4, [9, 5], [2, 0], [True, False], [[0, 0, 4, 4, 8], [0, 1, 2, 3, 4]]),
    # a large Q (a row inside one chunk, another across a chunk start), and an empty row
    (4, 3, 4, 1, 64, [7, 0, 12], [40, 0, 60], [True, False, True], [[2, 6], [], [1, 3, 4, 11]]),
]  # fmt: skip


@pytest.mark.parametrize("case", EMIT_ANY_CASES)
@pytest.mark.parametrize("limits", [(0.0, math.inf), (0.02, 0.3)])
def test_ssd_prefill_emits_at_any_token(case, limits, decay_budget):
    """An emit at any token of a row (inside a chunk as well as at its end) writes exactly the
    state after that token; the outputs and final states are bit for bit those of the call
    without emits."""
    H, P, N, G, Q, lengths, ncomp, his, emit_tokens = case
    gen = torch.Generator().manual_seed(11)
    T, R = sum(lengths), len(lengths)
    x, dt, A, B, C, D, dt_bias = make_ssm_params(H, P, N, G, T, gen)
    er = [r for r in range(R) for _ in emit_tokens[r]]
    et = [t for r in range(R) for t in emit_tokens[r]]
    num_slots = 1 + 2 * R + len(er)
    state = torch.randn(num_slots, H, P, N, generator=gen, dtype=torch.float64)
    state[0] = 0
    read = i64([1 + r for r in range(R)])
    write = i64([1 + R + r for r in range(R)])
    es = list(range(1 + 2 * R, num_slots))
    qsl = qsl_of(lengths)
    before = state.clone()
    args = (x, dt, A, B, C, D, dt_bias)
    y = K.ssd_prefill(
        *args, state, qsl, i64(ncomp), read, torch.tensor(his), write, i64(er), i64(et), i64(es), Q, *limits
    )
    plain = before.clone()
    e = i64([])
    y_plain = K.ssd_prefill(
        *args, plain, qsl, i64(ncomp), read, torch.tensor(his), write, e, e, e, Q, *limits
    )
    assert torch.equal(y, y_plain)
    assert torch.equal(state[: 1 + 2 * R], plain[: 1 + 2 * R])
    for r in range(R):
        s, n = int(qsl[r]), lengths[r]
        if n == 0:
            continue
        h0 = before[int(read[r])] if his[r] else torch.zeros(H, P, N, dtype=torch.float64)
        hs = states_seq(x[s : s + n], dt[s : s + n], A, B[s : s + n], dt_bias, h0, *limits)
        for row, tok, slot in zip(er, et, es):
            if row == r:
                torch.testing.assert_close(state[slot], hs[tok], rtol=1e-10, atol=1e-10)
                if tok == n - 1:  # the last token: the very state written as the final one
                    assert torch.equal(state[slot], state[int(write[r])])


def test_ssd_prefill_emits_at_chunk_ends_are_unchanged_by_emits_inside_chunks():
    """Chunk-end emits keep the chunk-end state of the scan (bit for bit), however many emits
    inside chunks the call also has."""
    gen = torch.Generator().manual_seed(12)
    H, P, N, G, Q = 4, 3, 5, 2, 8
    lengths, ncomp = [30, 17], [3, 8]
    x, dt, A, B, C, D, dt_bias = make_ssm_params(H, P, N, G, sum(lengths), gen)
    ends = [(r, t) for r in range(2) for t in range(lengths[r]) if (ncomp[r] + t + 1) % Q == 0]
    inside = [(0, 0), (0, 9), (1, 3), (1, 15)]
    base = torch.randn(3 + len(ends) + len(inside), H, P, N, generator=gen, dtype=torch.float64)
    base[0] = 0
    common = (x, dt, A, B, C, D, dt_bias)
    rest = (qsl_of(lengths), i64(ncomp), i64([1, 2]), torch.tensor([True, False]), i64([0, 0]))
    only_ends = base.clone()
    slots = list(range(3, 3 + len(ends)))
    K.ssd_prefill(
        *common, only_ends, *rest, i64([r for r, _ in ends]), i64([t for _, t in ends]), i64(slots), Q
    )
    both = base.clone()
    emits = ends + inside
    K.ssd_prefill(
        *common, both, *rest, i64([r for r, _ in emits]), i64([t for _, t in emits]),
        i64(list(range(3, 3 + len(emits)))), Q,
    )  # fmt: skip
    assert torch.equal(both[slots], only_ends[slots])


def test_ssd_prefill_emit_range_checks():
    gen = torch.Generator().manual_seed(2)
    x, dt, A, B, C, D, dt_bias = make_ssm_params(2, 2, 2, 1, 10, gen)
    common = (x, dt, A, B, C, D, dt_bias)
    rest = (i64([0, 10]), i64([0]), i64([0]), torch.tensor([False]), i64([1]))
    # a token inside a chunk is accepted, not only a chunk end
    state = torch.zeros(4, 2, 2, 2, dtype=torch.float64)
    K.ssd_prefill(*common, state, *rest, i64([0]), i64([4]), i64([2]), 4)
    hs = states_seq(x, dt, A, B, dt_bias, torch.zeros(2, 2, 2, dtype=torch.float64))
    torch.testing.assert_close(state[2], hs[4], rtol=1e-12, atol=1e-12)
    for row, tok in ((1, 0), (-1, 0), (0, 10), (0, -1)):
        state = torch.zeros(4, 2, 2, 2, dtype=torch.float64)
        with pytest.raises(ValueError, match="out of range"):
            K.ssd_prefill(*common, state, *rest, i64([row]), i64([tok]), i64([2]), 4)
        assert not bool(state.any())  # refused before anything is written


def test_ssd_prefill_dt_extremes_no_nan_fp32():
    gen = torch.Generator().manual_seed(3)
    H, P, N, G, Q = 4, 4, 4, 1, 8
    x, dt, A, B, C, D, dt_bias = make_ssm_params(H, P, N, G, 19, gen, dtype=torch.float32)
    dt[:5] = 30.0  # threshold branch
    dt[5:10] = -30.0  # dt -> 0
    A = A * 200.0  # decay underflow
    state = torch.zeros(3, H, P, N)
    y = K.ssd_prefill(
        x, dt, A, B, C, D, dt_bias, state, i64([0, 19]), i64([0]), i64([0]), torch.tensor([False]),
        i64([1]), i64([]), i64([]), i64([]), Q,
    )  # fmt: skip
    assert torch.isfinite(y).all() and torch.isfinite(state).all()
    yr, hs = ssm_seq_ref(x.double(), dt.double(), A.double(), B.double(), C.double(), D.double(),
                         dt_bias.double(), torch.zeros(H, P, N, dtype=torch.float64))  # fmt: skip
    torch.testing.assert_close(y.double(), yr, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state[1].double(), hs[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("T", [11, 12])  # padded chunks, and rows on chunk boundaries
def test_ssd_prefill_strided_views(T: int):
    """Production passes x/B/C/dt as views sliced out of one projection."""
    gen = torch.Generator().manual_seed(4)
    H, P, N, G, Q = 4, 3, 5, 2, 4
    width = H * P + 2 * G * N + H
    zx = torch.randn(T, width, generator=gen, dtype=torch.float64)
    x = zx[:, : H * P].view(T, H, P) if False else zx[:, : H * P].unflatten(1, (H, P))
    Bv = zx[:, H * P : H * P + G * N].unflatten(1, (G, N))
    Cv = zx[:, H * P + G * N : H * P + 2 * G * N].unflatten(1, (G, N))
    dtv = zx[:, H * P + 2 * G * N :]
    _, _, A, _, _, D, dt_bias = make_ssm_params(H, P, N, G, T, gen)
    s1 = torch.zeros(3, H, P, N, dtype=torch.float64)
    s2 = torch.zeros(3, H, P, N, dtype=torch.float64)
    args = (i64([0, T]), i64([0]), i64([0]), torch.tensor([False]), i64([1]), i64([]), i64([]), i64([]), Q)
    y1 = K.ssd_prefill(x, dtv, A, Bv, Cv, D, dt_bias, s1, *args)
    y2 = K.ssd_prefill(
        x.contiguous(), dtv.contiguous(), A, Bv.contiguous(), Cv.contiguous(), D, dt_bias, s2, *args
    )
    assert torch.equal(y1, y2) and torch.equal(s1, s2)


@pytest.mark.parametrize("lengths", [[1], [1, 1, 1], [4, 1, 3, 2], [6]])
@pytest.mark.parametrize("limits", [(0.0, math.inf), (0.02, 0.3)])
def test_selective_state_update_matches_sequential(lengths, limits):
    gen = torch.Generator().manual_seed(torch.seed() % (2**31))
    H, P, N, G = 6, 5, 4, 2
    T, R = sum(lengths), len(lengths)
    Wd = max(lengths) + 1
    x, dt, A, B, C, D, dt_bias = make_ssm_params(H, P, N, G, T, gen)
    num_slots = 1 + R * Wd + 2
    state = torch.randn(num_slots, H, P, N, generator=gen, dtype=torch.float64)
    state[0] = 0
    before = state.clone()
    # window of row r: slots 1 + r*Wd ... ; read slot = window[j] with j random; per-token writes
    # with some null entries; the read slot is also written (window semantics)
    read, writes = [], []
    for r, n in enumerate(lengths):
        win = [1 + r * Wd + i for i in range(Wd)]
        read.append(win[r % n])
        row = [win[t] if (t + r) % 3 != 2 else 0 for t in range(n)] + [0] * (Wd - n)
        writes.append(row)
    qsl = qsl_of(lengths)
    y = K.selective_state_update(x, dt, A, B, C, D, dt_bias, state, qsl, i64(read), i64(writes), *limits)
    expect = before.clone()
    for r in range(R):
        s, e = int(qsl[r]), int(qsl[r + 1])
        yr, hs = ssm_seq_ref(x[s:e], dt[s:e], A, B[s:e], C[s:e], D, dt_bias, before[read[r]], *limits)
        torch.testing.assert_close(y[s:e], yr, rtol=1e-12, atol=1e-12)
        for t in range(e - s):
            if writes[r][t] != 0:
                expect[writes[r][t]] = hs[t]
    torch.testing.assert_close(state, expect, rtol=1e-12, atol=1e-12)
    assert torch.equal(state[0], before[0])


def test_selective_state_update_softplus_overflow_fp32():
    H, P, N, G = 2, 2, 2, 1
    x = torch.ones(1, H, P)
    dt = torch.tensor([[100.0, -100.0]])
    A = torch.tensor([-1.0, -1.0])
    B = torch.ones(1, G, N)
    C = torch.ones(1, G, N)
    D = torch.zeros(H)
    state = torch.zeros(2, H, P, N)
    y = K.selective_state_update(x, dt, A, B, C, D, torch.zeros(H), state, i64([0, 1]), i64([1]), i64([[1]]))
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y[0, 0], torch.full((P,), 100.0 * N))


def test_prefill_equals_decode_chain():
    """prefill(L) == prefill(L1) + prefill(L2 | state) == prefill(L1) + L2 x decode(T=1)."""
    gen = torch.Generator().manual_seed(torch.seed() % (2**31))
    H, P, N, G, Q, L, L1 = 4, 3, 6, 2, 8, 29, 11
    x, dt, A, B, C, D, dt_bias = make_ssm_params(H, P, N, G, L, gen)
    lim = (0.01, 5.0)
    st = torch.zeros(8, H, P, N, dtype=torch.float64)
    e = i64([])
    y_full = K.ssd_prefill(
        x, dt, A, B, C, D, dt_bias, st, i64([0, L]), i64([0]), i64([0]), torch.tensor([False]), i64([1]), e, e, e,
        Q, *lim,
    )  # fmt: skip
    y1 = K.ssd_prefill(
        x[:L1], dt[:L1], A, B[:L1], C[:L1], D, dt_bias, st, i64([0, L1]), i64([0]), i64([0]),
        torch.tensor([False]), i64([2]), e, e, e, Q, *lim,
    )  # fmt: skip
    y2 = K.ssd_prefill(
        x[L1:], dt[L1:], A, B[L1:], C[L1:], D, dt_bias, st, i64([0, L - L1]), i64([L1]), i64([2]),
        torch.tensor([True]), i64([3]), e, e, e, Q, *lim,
    )  # fmt: skip
    torch.testing.assert_close(torch.cat([y1, y2]), y_full, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(st[3], st[1], rtol=1e-11, atol=1e-11)
    # decode chain from the state after L1, ping-pong between slots 4 and 5
    cur = 2
    ys = []
    for t in range(L1, L):
        nxt = 4 if cur != 4 else 5
        ys.append(
            K.selective_state_update(
                x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], D, dt_bias, st, i64([0, 1]),
                i64([cur]), i64([[nxt]]), *lim,
            )
        )  # fmt: skip
        cur = nxt
    torch.testing.assert_close(torch.cat([y1, *ys]), y_full, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(st[cur], st[1], rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_prefill_matches_sequential(W, with_bias):
    gen = torch.Generator().manual_seed(torch.seed() % (2**31))
    Dc = 7
    lengths = [1, 2, 9, 0, 5]
    his = [True, False, True, False, True]
    R, T = len(lengths), sum(lengths)
    x = torch.randn(T, Dc, generator=gen, dtype=torch.float64)
    w = torch.randn(Dc, W, generator=gen, dtype=torch.float64)
    b = torch.randn(Dc, generator=gen, dtype=torch.float64) if with_bias else None
    ns = 2 * R + 6
    cs = torch.randn(ns, Dc, W - 1, generator=gen, dtype=torch.float64)
    cs[0] = 0
    before = cs.clone()
    read = [1 + r for r in range(R)]
    write = [R + 1 + r for r in range(R)]
    er, et, es = [2, 2, 4, 0], [0, 6, 3, 0], [2 * R + 1, 2 * R + 2, 2 * R + 3, 0]
    qsl = qsl_of(lengths)
    y = K.causal_conv1d_prefill(
        x, w, b, cs, qsl, i64(read), torch.tensor(his), i64(write), i64(er), i64(et), i64(es), "silu"
    )
    for r in range(R):
        s, e = int(qsl[r]), int(qsl[r + 1])
        if e == s:
            assert torch.equal(cs[write[r]], before[write[r]])
            continue
        s0 = before[read[r]] if his[r] else torch.zeros(Dc, W - 1, dtype=torch.float64)
        yr, ss = conv_seq_ref(x[s:e], w, b, s0)
        torch.testing.assert_close(y[s:e], yr, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(cs[write[r]], ss[-1], rtol=1e-12, atol=1e-12)
        for row, tok, slot in zip(er, et, es):
            if row == r and slot != 0:
                torch.testing.assert_close(cs[slot], ss[tok], rtol=1e-12, atol=1e-12)
    assert torch.equal(cs[0], before[0])
    for sl in read:
        assert torch.equal(cs[sl], before[sl])


@pytest.mark.parametrize("W", [2, 4])
def test_conv_prefill_emits_at_every_token(W):
    """An emit at any token writes the W - 1 inputs ending there (initial state columns
    included when the token is among the first W - 2 of its row)."""
    gen = torch.Generator().manual_seed(6)
    Dc = 5
    lengths = [7, 1, 2]
    his = [True, True, False]
    R, T = len(lengths), sum(lengths)
    x = torch.randn(T, Dc, generator=gen, dtype=torch.float64)
    w = torch.randn(Dc, W, generator=gen, dtype=torch.float64)
    er = [r for r in range(R) for _ in range(lengths[r])]
    et = [t for r in range(R) for t in range(lengths[r])]
    es = list(range(1 + R, 1 + R + T))
    cs = torch.randn(1 + R + T, Dc, W - 1, generator=gen, dtype=torch.float64)
    cs[0] = 0
    before = cs.clone()
    qsl = qsl_of(lengths)
    read = list(range(1, 1 + R))
    K.causal_conv1d_prefill(
        x, w, None, cs, qsl, i64(read), torch.tensor(his), i64([0] * R), i64(er), i64(et), i64(es), None
    )
    for r in range(R):
        s, e = int(qsl[r]), int(qsl[r + 1])
        s0 = before[read[r]] if his[r] else torch.zeros(Dc, W - 1, dtype=torch.float64)
        _, ss = conv_seq_ref(x[s:e], w, None, s0, act=False)
        for row, tok, slot in zip(er, et, es):
            if row == r:
                assert torch.equal(cs[slot], ss[tok])


@pytest.mark.parametrize("W", [2, 4])
def test_conv_update_matches_sequential(W):
    gen = torch.Generator().manual_seed(torch.seed() % (2**31))
    Dc = 5
    lengths = [1, 4, 2]
    R, T = len(lengths), sum(lengths)
    Wd = 5
    x = torch.randn(T, Dc, generator=gen, dtype=torch.float64)
    w = torch.randn(Dc, W, generator=gen, dtype=torch.float64)
    b = torch.randn(Dc, generator=gen, dtype=torch.float64)
    ns = 1 + R * Wd
    cs = torch.randn(ns, Dc, W - 1, generator=gen, dtype=torch.float64)
    cs[0] = 0
    before = cs.clone()
    read, writes = [], []
    for r, n in enumerate(lengths):
        win = [1 + r * Wd + i for i in range(Wd)]
        read.append(win[n - 1])
        writes.append([win[t] if t != 1 else 0 for t in range(n)] + [0] * (Wd - n))
    qsl = qsl_of(lengths)
    y = K.causal_conv1d_update(x, w, b, cs, qsl, i64(read), i64(writes), "silu")
    expect = before.clone()
    for r in range(R):
        s, e = int(qsl[r]), int(qsl[r + 1])
        yr, ss = conv_seq_ref(x[s:e], w, b, before[read[r]])
        torch.testing.assert_close(y[s:e], yr, rtol=1e-12, atol=1e-12)
        for t in range(e - s):
            if writes[r][t]:
                expect[writes[r][t]] = ss[t]
    torch.testing.assert_close(cs, expect, rtol=1e-12, atol=1e-12)


def test_conv_prefill_then_update_equals_full():
    gen = torch.Generator().manual_seed(5)
    Dc, W, L, L1 = 6, 4, 13, 2  # L1 < W - 1: initial state columns are carried into the final state
    x = torch.randn(L, Dc, generator=gen, dtype=torch.float64)
    w = torch.randn(Dc, W, generator=gen, dtype=torch.float64)
    b = torch.randn(Dc, generator=gen, dtype=torch.float64)
    cs = torch.zeros(6, Dc, W - 1, dtype=torch.float64)
    e = i64([])
    y_full = K.causal_conv1d_prefill(
        x, w, b, cs, i64([0, L]), i64([0]), torch.tensor([False]), i64([1]), e, e, e
    )
    y1 = K.causal_conv1d_prefill(
        x[:L1], w, b, cs, i64([0, L1]), i64([0]), torch.tensor([False]), i64([2]), e, e, e
    )
    y2 = K.causal_conv1d_prefill(
        x[L1:5], w, b, cs, i64([0, 5 - L1]), i64([2]), torch.tensor([True]), i64([3]), e, e, e
    )
    y3 = K.causal_conv1d_update(x[5:], w, b, cs, i64([0, L - 5]), i64([3]), i64([[4] * (L - 5)]))
    torch.testing.assert_close(torch.cat([y1, y2, y3]), y_full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cs[4], cs[1], rtol=1e-12, atol=1e-12)


def test_copy_slots_batched_and_sequential():
    st = torch.arange(6 * 3, dtype=torch.float64).view(6, 3)
    ref = st.clone()
    K.copy_slots(st, i64([1, 2]), i64([3, 4]))
    ref[3], ref[4] = ref[1].clone(), ref[2].clone()
    assert torch.equal(st, ref)
    # chained: 1 -> 5, then 5 -> 2 sees the new value; copy to null slot skipped
    K.copy_slots(st, i64([1, 5, 3]), i64([5, 2, 0]))
    ref[5] = ref[1].clone()
    ref[2] = ref[5].clone()
    assert torch.equal(st, ref)
    K.copy_slots(st, i64([]), i64([]))
    assert torch.equal(st, ref)


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_states_kept_in_low_precision_are_computed_in_float32_and_rounded_once(low: torch.dtype) -> None:
    """A checkpoint may ask for bfloat16 / float16 Mamba states: the recurrence still runs in
    float32 (the state widened when read), and each state written is the float32 one rounded
    once: exactly what the float32 op gives on the widened state, then rounded. A verify row's
    later tokens start from the unrounded state, not from a rounded one."""
    gen = torch.Generator().manual_seed(7)
    H, P, N, G = 4, 3, 4, 2
    lengths = [3, 1, 4]
    T, R = sum(lengths), len(lengths)
    x, dt, A, B, C, D, dt_bias = make_ssm_params(H, P, N, G, T, gen, dtype=torch.float32)
    slots = 1 + 5 * R
    state = torch.randn(slots, H, P, N, generator=gen).to(low)
    wide = state.float()
    read = [1 + 5 * r for r in range(R)]
    writes = [[1 + 5 * r + 1 + t if t < n else 0 for t in range(4)] for r, n in enumerate(lengths)]
    qsl = qsl_of(lengths)
    y = K.selective_state_update(x, dt, A, B, C, D, dt_bias, state, qsl, i64(read), i64(writes))
    y32 = K.selective_state_update(x, dt, A, B, C, D, dt_bias, wide, qsl, i64(read), i64(writes))
    assert torch.equal(y, y32) and torch.equal(state, wide.to(low))
    # prefill: a row from a kept state, emitting inside its chunk
    state2 = torch.randn(4, H, P, N, generator=gen).to(low)
    wide2 = state2.float()
    xp, dtp, Ap, Bp, Cp, Dp, biasp = make_ssm_params(H, P, N, G, 11, gen, dtype=torch.float32)
    args = (i64([0, 11]), i64([5]), i64([1]), torch.tensor([True]), i64([2]), i64([0]), i64([4]), i64([3]), 8)
    yp = K.ssd_prefill(xp, dtp, Ap, Bp, Cp, Dp, biasp, state2, *args)
    yp32 = K.ssd_prefill(xp, dtp, Ap, Bp, Cp, Dp, biasp, wide2, *args)
    assert torch.equal(yp, yp32) and torch.equal(state2, wide2.to(low))
