"""The CUDA kernels' own code, run on the CPU: kernels/csrc/cuda/*.cu are compiled with g++ against the small
CUDA emulation in tests/cuda_emu/include (each CUDA thread a fiber, switched at __syncthreads
and the warp shuffles), together with ops.cpp built with -DHS_EMULATE, which
registers the same ops as torch.ops.hybridserve_emu.* for CPU tensors. The results are compared
with the float64 twins of kernels/reference.py.

This checks the kernels' indexing, chunking, slot handling and arithmetic on a machine without a
GPU (CI). It says nothing about timing or GPU memory-model behaviour: tests/gpu does that on a
device. Shapes are small because every CUDA thread of a block runs in turn on one core here.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from cuda_emu.build import build_emulated_ops
from hybridserve.kernels import dispatch, reference


@pytest.fixture(scope="module")
def emu():
    assert shutil.which("c++") or shutil.which("g++"), "no host C++ compiler"
    return build_emulated_ops()


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert bool(torch.isfinite(a).all())
    return float((a - b).abs().max()) / max(float(b.pow(2).mean().sqrt()), 1e-30)


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    """fp32 I/O: max error < 1e-5 x rms; 16-bit outputs: |a - b| <= 1.6e-2 |b| + 1e-2 rms
    (the rounding of the output itself; docs/kernel-design.md, "Testing and tolerances")."""
    if dtype == torch.float32:
        return _rel(a, b) < 1e-5
    a, b = a.double(), b.double()
    rms = float(b.pow(2).mean().sqrt())
    return bool(((a - b).abs() <= 1.6e-2 * b.abs() + 1e-2 * rms).all())


def _qsl(lengths: list[int]) -> torch.Tensor:
    q = [0]
    for n in lengths:
        q.append(q[-1] + n)
    return torch.tensor(q)


def _ssm_inputs(T: int, H: int, P: int, N: int, G: int, dtype: torch.dtype, g: torch.Generator):
    return dict(
        x=torch.randn((T, H, P), generator=g).to(dtype),
        dt=torch.randn((T, H), generator=g).to(dtype),
        A=-(torch.rand(H, generator=g) + 1),
        B=(torch.randn((T, G, N), generator=g) * 0.5).to(dtype),
        C=(torch.randn((T, G, N), generator=g) * 0.5).to(dtype),
        D=torch.randn(H, generator=g),
        dt_bias=torch.rand(H, generator=g) - 4,
    )


@pytest.mark.parametrize("shape", [(4, 16, 16, 2), (2, 8, 96, 1), (2, 4, 128, 2), (2, 4, 256, 1)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_selective_state_update(emu, shape, dtype):
    H, P, N, G = shape
    g = _g(1)
    lengths = [3, 1, 0, 2]
    R, Wn = len(lengths), 3
    c = _ssm_inputs(sum(lengths), H, P, N, G, dtype, g)
    pool = torch.full((R * Wn + 2, H, P, N), math.nan)
    pool[0] = 0
    perm = (torch.randperm(R * Wn + 1, generator=g) + 1).tolist()
    win = [perm[r * Wn : (r + 1) * Wn] for r in range(R)]
    read = torch.tensor([win[r][1] for r in range(R)])
    ws = torch.zeros((R, Wn), dtype=torch.int64)
    for r in range(R):
        for t in range(lengths[r]):
            ws[r, t] = win[r][t]
    ws[0, 1] = 0  # null entry: skipped
    for r in range(R):
        pool[read[r]] = torch.randn((H, P, N), generator=g)
    args = lambda cast: [cast(c[k]) for k in ("x", "dt", "A", "B", "C", "D", "dt_bias")]  # noqa: E731
    p_emu = pool.clone()
    y = emu.selective_state_update(*args(lambda t: t), p_emu, _qsl(lengths), read, ws, 0.0, math.inf)
    p_ref = pool.double()
    y_ref = reference.selective_state_update(*args(lambda t: t.double()), p_ref, _qsl(lengths), read, ws)
    assert _close(y, y_ref, dtype)
    written = sorted({int(s) for s in ws.flatten().tolist() if s})
    assert _rel(p_emu[written], p_ref[written]) < 1e-5
    others = [s for s in range(pool.shape[0]) if s not in written]
    assert torch.equal(p_emu[others].nan_to_num(7.0), pool[others].nan_to_num(7.0))


@pytest.mark.parametrize("where", ["dt", "dt_bias"])
def test_a_nan_dt_stays_nan(emu, where):
    """dt's clamp keeps a NaN, as torch.clamp does (fmaxf made it dt_min: finite outputs from a
    corrupt checkpoint, past the engine's non-finite-logits check)."""
    H, P, N, G = 4, 16, 16, 2
    lengths = [1, 1]
    c = _ssm_inputs(sum(lengths), H, P, N, G, torch.float32, _g(3))
    c[where].view(-1)[0] = math.nan
    pool = torch.zeros((5, H, P, N))
    pool[1:3] = torch.randn((2, H, P, N), generator=_g(4))
    read, ws = torch.tensor([1, 2]), torch.tensor([[3], [4]])
    args = lambda cast: [cast(c[k]) for k in ("x", "dt", "A", "B", "C", "D", "dt_bias")]  # noqa: E731
    p_emu, p_ref = pool.clone(), pool.double()
    y = emu.selective_state_update(*args(lambda t: t), p_emu, _qsl(lengths), read, ws, 0.0, math.inf)
    y_ref = reference.selective_state_update(*args(lambda t: t.double()), p_ref, _qsl(lengths), read, ws)
    assert torch.isnan(y_ref).any()
    assert torch.equal(torch.isnan(y), torch.isnan(y_ref))
    assert torch.equal(torch.isnan(p_emu), torch.isnan(p_ref))


SSD_CASES = {
    # (H, P, N, G, Q), lengths, computed, has_initial_state
    "small": ((4, 16, 16, 2, 16), [1, 15, 16, 17, 0, 45, 3], [0, 5, 16, 9, 3, 20, 30], [0, 1, 1, 0, 0, 1, 1]),
    # partial 64x64 GEMM tiles (P = 80, N = 96), two query tiles per chunk (Q = 128), causal tile skip
    "tiles": ((2, 80, 96, 1, 128), [130, 60, 1], [0, 100, 7], [0, 1, 1]),
    # P * N not a multiple of four: the state passing's one-element path
    "odd": ((2, 9, 15, 1, 16), [40, 7, 21], [3, 0, 16], [1, 0, 1]),
}


def _any_emits(lengths: list[int], computed: list[int], Q: int) -> list[tuple[int, int]]:
    """Emits at tokens of every kind: a row's first and last tokens, tokens inside chunks (in a
    row's short first chunk too), chunk ends, two consecutive tokens, and one token twice."""
    emits = []
    for r, (n, c) in enumerate(zip(lengths, computed)):
        if n == 0:
            continue
        toks = {0, n - 1, n // 2, n // 3}
        toks |= {t for t in range(n) if (c + t + 1) % Q == 0}
        toks |= {t for t in range(n) if (c + t + 1) % Q == Q // 2 + 1}  # just past mid-chunk
        emits += [(r, t) for t in sorted(toks)]
    emits.append(emits[len(emits) // 2])  # the same token again, to another slot
    return emits


@pytest.mark.parametrize("emit_kind", ["chunk_ends", "any_token"])
@pytest.mark.parametrize("case", list(SSD_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ssd_prefill(emu, dtype, case, emit_kind):
    (H, P, N, G, Q), lengths, computed, init = SSD_CASES[case]
    g = _g(2)
    his = torch.tensor([bool(v) for v in init])
    R = len(lengths)
    c = _ssm_inputs(sum(lengths), H, P, N, G, dtype, g)
    if emit_kind == "chunk_ends":
        emits = [(r, t) for r in range(R) for t in range(lengths[r]) if (computed[r] + t + 1) % Q == 0]
        emits.append((0, lengths[0] - 1))  # a row's last token
    else:
        # the host splits chunks after each of these: chunks that start and end off multiples of Q
        emits = _any_emits(lengths, computed, Q)
    S = 2 * R + len(emits) + 2
    perm = (torch.randperm(S - 1, generator=g) + 1).tolist()
    read = torch.tensor(perm[:R])
    write = torch.tensor(perm[R : 2 * R])
    write[1] = read[1]
    write[2] = 0
    eslot = torch.tensor(perm[2 * R : 2 * R + len(emits)])
    pool = torch.full((S, H, P, N), math.nan)
    pool[0] = 0
    for r in range(R):
        if his[r]:
            pool[read[r]] = torch.randn((H, P, N), generator=g)
    er = torch.tensor([e[0] for e in emits])
    et = torch.tensor([e[1] for e in emits])
    keys = ("x", "dt", "A", "B", "C", "D", "dt_bias")
    rest = (_qsl(lengths), torch.tensor(computed), read, his, write, er, et, eslot, Q)
    p_emu = pool.clone()
    y = emu.ssd_prefill(*[c[k] for k in keys], p_emu, *rest, 0.0, math.inf)
    p_ref = pool.double()
    y_ref = reference.ssd_prefill(*[c[k].double() for k in keys], p_ref, *rest)
    assert _close(y, y_ref, dtype)
    written = sorted({int(s) for s, n in zip(write.tolist(), lengths) if s and n} | set(eslot.tolist()))
    assert _rel(p_emu[written], p_ref[written]) < 1e-5
    others = [s for s in range(S) if s not in written]
    assert torch.equal(p_emu[others].nan_to_num(7.0), pool[others].nan_to_num(7.0))
    # an emit past its row's end, or of a row the call does not have
    for row, tok in ((0, lengths[0]), (R, 0)):
        with pytest.raises(ValueError, match="out of range"):
            emu.ssd_prefill(*[c[k] for k in keys], pool.clone(), *rest[:5], torch.tensor([row]),
                            torch.tensor([tok]), torch.tensor([1]), Q, 0.0, math.inf)  # fmt: skip


def test_ssd_prefill_passes_states_through_more_chunks_than_one_block_holds(emu):
    """A row of 258 chunks: the state passing reads the chunks' decays in windows of 256 and keeps
    eight chunk states in flight, so a window boundary and a partial group are both crossed."""
    H, P, N, G, Q = 1, 4, 4, 1, 4
    L = 258 * Q - 1  # the last chunk partial
    g = _g(4)
    c = _ssm_inputs(L, H, P, N, G, torch.float32, g)
    pool = torch.zeros((3, H, P, N))
    pool[1] = torch.randn((H, P, N), generator=g)
    z = torch.zeros(0, dtype=torch.int64)
    keys = ("x", "dt", "A", "B", "C", "D", "dt_bias")
    rest = (
        _qsl([L]),
        torch.tensor([0]),
        torch.tensor([1]),
        torch.tensor([True]),
        torch.tensor([2]),
        z,
        z,
        z,
        Q,
    )
    p_emu = pool.clone()
    y = emu.ssd_prefill(*[c[k] for k in keys], p_emu, *rest, 0.0, math.inf)
    p_ref = pool.double()
    y_ref = reference.ssd_prefill(*[c[k].double() for k in keys], p_ref, *rest)
    assert _close(y, y_ref, torch.float32)
    assert _rel(p_emu[2], p_ref[2]) < 1e-5


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("sdtype", [torch.float32, torch.bfloat16], ids=str)
def test_conv1d_prefill_and_update(emu, W, sdtype):
    g = _g(3)
    Dc = 140  # two channel blocks, the second partial
    lengths = [1, 2, 0, 9]
    R = len(lengths)
    T = sum(lengths)
    x = torch.randn((T, Dc + 8), generator=g)[:, 4 : 4 + Dc]  # strided view
    w = torch.randn((Dc, W), generator=g)
    b = torch.randn(Dc, generator=g)
    S = 3 * R + 6
    pool = torch.full((S, Dc, W - 1), math.nan).to(sdtype)
    pool[0] = 0
    read = torch.tensor([1, 2, 3, 4])
    his = torch.tensor([True, False, True, True])
    for r in range(R):
        pool[read[r]] = torch.randn((Dc, W - 1), generator=g).to(sdtype)
    write = torch.tensor([5, 6, 7, 4])
    er, et, es = torch.tensor([3, 3, 1]), torch.tensor([0, 4, 0]), torch.tensor([8, 9, 10])
    p_emu = pool.clone()
    y = emu.causal_conv1d_prefill(x, w, b, p_emu, _qsl(lengths), read, his, write, er, et, es, "silu")
    p_ref = pool.double()
    y_ref = reference.causal_conv1d_prefill(x.double(), w.double(), b.double(), p_ref, _qsl(lengths), read, his,
                                            write, er, et, es, "silu")  # fmt: skip
    assert _rel(y, y_ref) < 1e-5
    written = [5, 6, 4, 8, 9, 10]
    assert _rel(p_emu[written], p_ref[written]) < (1e-6 if sdtype == torch.float32 else 1e-2)
    assert torch.equal(p_emu[[11, 12]].isnan(), pool[[11, 12]].isnan())
    # multi-token update: window slot t gets the window after token t
    ul = [3, 1]
    xu = torch.randn((4, Dc), generator=g)
    ws = torch.tensor([[11, 12, 13], [14, 0, 0]])
    ru = torch.tensor([5, 4])
    p2, p2r = p_emu.clone(), p_emu.double()
    yu = emu.causal_conv1d_update(xu, w, b, p2, _qsl(ul), ru, ws, "silu")
    yur = reference.causal_conv1d_update(xu.double(), w.double(), b.double(), p2r, _qsl(ul), ru, ws, "silu")
    assert _rel(yu, yur) < 1e-5
    assert _rel(p2[[11, 12, 13, 14]], p2r[[11, 12, 13, 14]]) < (1e-6 if sdtype == torch.float32 else 1e-2)


def test_conv1d_prefill_emits_at_every_token(emu):
    """An emit at any token (inside the first W - 2 tokens of a row too, where the window still
    holds initial state columns) gathers the W - 1 inputs ending there, as the twin does."""
    g = _g(6)
    Dc, W = 40, 4
    lengths = [5, 1, 2]
    R, T = len(lengths), sum(lengths)
    x = torch.randn((T, Dc), generator=g)
    w = torch.randn((Dc, W), generator=g)
    pool = torch.full((1 + 2 * R + T, Dc, W - 1), math.nan)
    pool[0] = 0
    read = torch.arange(1, 1 + R)
    his = torch.tensor([True, True, False])
    for r in range(R):
        pool[read[r]] = torch.randn((Dc, W - 1), generator=g)
    write = torch.arange(1 + R, 1 + 2 * R)
    er = torch.tensor([r for r in range(R) for _ in range(lengths[r])])
    et = torch.tensor([t for r in range(R) for t in range(lengths[r])])
    es = torch.arange(1 + 2 * R, 1 + 2 * R + T)
    p_emu, p_ref = pool.clone(), pool.double()
    args = (_qsl(lengths), read, his, write, er, et, es, None)
    y = emu.causal_conv1d_prefill(x, w, None, p_emu, *args)
    y_ref = reference.causal_conv1d_prefill(x.double(), w.double(), None, p_ref, *args)
    assert _rel(y, y_ref) < 1e-5
    written = [*write.tolist(), *es.tolist()]
    assert torch.equal(p_emu[written].double(), p_ref[written])  # copies of the inputs, exactly


def test_copy_slots(emu):
    g = _g(4)
    pool = torch.randn((10, 3, 5), generator=g)
    src = torch.tensor([1, 2, 5, 3, 7, 4])
    dst = torch.tensor([2, 3, 1, 6, 0, 8])
    a, b = pool.clone(), pool.clone()
    emu.copy_slots(a, src, dst)
    for s, d in zip(src.tolist(), dst.tolist()):
        if d:
            b[d] = b[s].clone()
    assert torch.equal(a, b)
    bf = pool.to(torch.bfloat16)[:, :, :3].contiguous()  # 6-byte rows: the byte-wise path
    c1, c2 = bf.clone(), bf.clone()
    emu.copy_slots(c1, torch.tensor([1, 2]), torch.tensor([3, 4]))
    reference.copy_slots(c2, torch.tensor([1, 2]), torch.tensor([3, 4]))
    assert torch.equal(c1, c2)


@pytest.mark.parametrize("V", [300, 2500, 9001])
def test_rejection_sample_matches_twin(emu, V):
    """V = 9001 spans three vocabulary tiles of the CUDA op, the last one partial and not a
    multiple of four."""
    g = _g(5)
    ks = [3, 0, 2, 1, 3]
    greedy = torch.tensor([False, False, True, False, True])
    M, Kt = sum(k + 1 for k in ks), sum(ks)
    p = torch.softmax(torch.randn((M, V), generator=g) * 3, -1)
    q = torch.softmax(torch.randn((Kt, V), generator=g) * 3, -1)
    logits = torch.randn((M, V), generator=g)
    drafts = torch.multinomial(q, 1, generator=g).flatten()
    drafts[3] = int(logits[4].argmax())  # greedy row 2: first draft accepted
    u = torch.rand(Kt, generator=g)
    u[0] = 0.0  # accept
    noise = -torch.log(torch.rand((len(ks), V), generator=g))
    kt = torch.tensor(ks)
    zeros = torch.zeros(len(ks), dtype=torch.int64)
    for dp in (q, None):
        got = emu.rejection_sample(p, logits, drafts, kt, greedy, dp, u, noise, zeros, zeros)
        want = dispatch.rejection_sample_reference(p, logits, drafts, kt, greedy, dp, u, noise)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # Philox: deterministic per (seed, offset), independent of the other rows
    seeds = torch.arange(len(ks)) + 3
    a = emu.rejection_sample(p, None, drafts, kt, greedy, q, None, None, seeds, zeros)
    b = emu.rejection_sample(p, None, drafts, kt, greedy, q, None, None, seeds, zeros)
    assert torch.equal(a[0], b[0])
    s2 = seeds.clone()
    s2[1:] += 100
    c = emu.rejection_sample(p, None, drafts, kt, greedy, q, None, None, s2, zeros)
    assert torch.equal(c[0][:4], a[0][:4])
    toks = a[0].tolist()
    assert all(-1 <= t < V for t in toks)


def test_rejection_sample_ties_across_tiles_pick_the_first_index(emu):
    """Equal maxima in different vocabulary tiles: greedy rows take the first index, as the twin
    does, wherever the tiles' partial results are combined."""
    V, ks = 12289, [1, 0]
    M = sum(k + 1 for k in ks)
    logits = torch.zeros((M, V))
    logits[0, [9000, 5000, 100]] = 2.0  # first index 100 (tile 0) beats tiles 1 and 2
    logits[1, [8191, 8192, 12288]] = 3.0  # the last id of tile 1 beats tile 2's first
    logits[2, [4097, 12000]] = 1.0
    p = torch.softmax(logits, -1)
    drafts = torch.tensor([100])
    kt = torch.tensor(ks)
    greedy = torch.tensor([True, True])
    zeros = torch.zeros(2, dtype=torch.int64)
    got = emu.rejection_sample(p, logits, drafts, kt, greedy, None, None, None, zeros, zeros)
    want = dispatch.rejection_sample_reference(p, logits, drafts, kt, greedy, None, None, None)
    assert got[0].tolist() == want[0].tolist() == [100, 8191, 4097]
    assert got[1].tolist() == want[1].tolist() == [1, 0]


@pytest.mark.parametrize("reject_at", [0, 255, 256, 280, None])
def test_rejection_sample_long_draft_chains(emu, reject_at):
    """More drafts than a CTA has threads: the acceptance tests run in windows of 256, and the
    first rejection is found in the right window (or none, and the bonus token follows)."""
    V, k = 64, 300
    g = _g(6)
    p = torch.softmax(torch.randn((k + 1, V), generator=g), -1)
    drafts = torch.randint(0, V, (k,), generator=g)
    u = torch.zeros(k)
    if reject_at is not None:
        u[reject_at] = 1.0  # u * q(d) < p(d) fails for q = 1
    noise = -torch.log(torch.rand((1, V), generator=g))
    args = (p, None, drafts, torch.tensor([k]), torch.tensor([False]), None, u, noise)
    got = emu.rejection_sample(*args, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    want = dispatch.rejection_sample_reference(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert int(got[1]) == (k if reject_at is None else reject_at)


def test_rejection_sample_refuses_rows_that_do_not_match_the_drafts(emu):
    """Counts given on the host are checked against the target rows (each request owns k + 1):
    a mismatch would make the kernels read and write past the rows."""
    p = torch.full((4, 8), 1.0 / 8)
    z = torch.zeros(2, dtype=torch.int64)
    args = (p, None, torch.tensor([1, 2, 3]), torch.tensor([2, 1]), torch.tensor([False, False]), None)
    with pytest.raises(ValueError, match=r"target_probs has 4 rows, but the drafts need sum\(k \+ 1\) = 5"):
        emu.rejection_sample(*args, None, None, z, z)


def test_rejection_sample_philox_noise_covers_every_tile(emu):
    """Bonus tokens over a flat distribution with the op's own Philox noise: every tile's ids are
    drawn about as often as its share of the vocabulary, different seeds give different tokens,
    and every position of a four-id group is drawn (noise indexed by the wrong id, word or seed
    would favour one tile or position, or repeat tokens)."""
    V, R = 9001, 60
    p = torch.full((R, V), 1.0 / V)
    kt = torch.zeros(R, dtype=torch.int64)
    greedy = torch.zeros(R, dtype=torch.bool)
    toks, acc = emu.rejection_sample(
        p, None, torch.zeros(0, dtype=torch.int64), kt, greedy, None, None, None,
        torch.arange(R) + 7, torch.zeros(R, dtype=torch.int64),
    )  # fmt: skip
    assert acc.tolist() == [0] * R
    ids = toks.tolist()
    assert len(set(ids)) >= R - 3 and all(0 <= i < V for i in ids)
    # every word of a draw is used: with one word for all four ids of a group, ties would always
    # go to the group's first id, a multiple of four
    assert {i % 4 for i in ids} == {0, 1, 2, 3}
    per_tile = torch.bincount(toks // 4096, minlength=3).tolist()
    expected = [R * 4096 / V, R * 4096 / V, R * 809 / V]
    for got, want in zip(per_tile, expected, strict=True):
        assert abs(got - want) <= 4 * want**0.5 + 2, (per_tile, expected)


@pytest.mark.parametrize("N", [16, 40])
def test_mamba1_scan_matches_twin(emu, N):
    """Jamba's Mamba1 scan (kernels/csrc/cuda/mamba1.cu): prefill-like rows (one from zeros) with
    writes after several tokens, and decode-like rows writing after every token, against the
    float64 twin of kernels/selective_scan.py."""
    from hybridserve.kernels.selective_scan import selective_scan_rows

    g = _g(7)
    lengths, Dc = [5, 1, 0, 7], 40
    T = sum(lengths)
    x = torch.randn((T, Dc), generator=g)
    dt = torch.rand((T, Dc), generator=g) * 0.3
    A = -torch.rand((Dc, N), generator=g) * 4
    B, C = torch.randn((T, N), generator=g), torch.randn((T, N), generator=g)
    D = torch.randn(Dc, generator=g)
    pool = torch.randn((12, Dc, N), generator=g)
    pool[0] = 0
    read = torch.tensor([1, 2, 3, 4])
    has_init = torch.tensor([True, False, True, True])
    # (row, token, slot) sorted by row then token; slot 0 is skipped; row 3 writes after every token
    writes = [(0, 1, 5), (0, 4, 6), (1, 0, 7), (1, 0, 0), *[(3, t, 8 + t % 4) for t in range(4, 7)]]
    w = tuple(torch.tensor(c, dtype=torch.int64) for c in zip(*writes))
    p_emu = pool.clone()
    y = emu.mamba1_scan(x, dt, A, B, C, D, p_emu, _qsl(lengths), read, has_init, *w)
    p_ref = pool.double()
    want = selective_scan_rows(
        x.double(), dt.double(), A.double(), B.double(), C.double(), D.double(), p_ref, _qsl(lengths), read,
        has_init, w,
    )  # fmt: skip
    assert _rel(y, want) < 1e-5
    assert _rel(p_emu, p_ref) < 1e-5
    assert torch.equal(p_emu[0], pool[0]) and torch.equal(p_emu[11], pool[11])  # untouched
    with pytest.raises(ValueError, match="out of range"):
        emu.mamba1_scan(x, dt, A, B, C, D, p_emu, _qsl(lengths), read, has_init, *w[:2], w[2] + 20)
