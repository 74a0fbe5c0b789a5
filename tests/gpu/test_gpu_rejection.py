"""rejection_sample (one launch, greedy + random rows) vs its torch twin and the target
distribution."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import DEVICE, ON_GPU, gen

from hybridserve.kernels import dispatch as K
from sampling_stats import chisquare_pvalue


def _dirichlet(n, V, g, zeros=0.0):
    p = -torch.log(torch.rand((n, V), generator=g, dtype=torch.float64))
    if zeros:
        p = p * (torch.rand((n, V), generator=g) >= zeros)
        p[:, 0] += 1e-3
    return (p / p.sum(-1, keepdim=True)).float()


def _batch(ks, V, g, greedy, with_q=True, zeros=0.3):
    M = sum(k + 1 for k in ks)
    p = _dirichlet(M, V, g, zeros).to(DEVICE)
    q = _dirichlet(sum(ks), V, g, zeros).to(DEVICE) if with_q else None
    logits = torch.randn((M, V), generator=g).to(DEVICE)
    if with_q and sum(ks):
        drafts = torch.multinomial(q.cpu(), 1, generator=g).flatten()
    else:
        drafts = torch.randint(0, V, (sum(ks),), generator=g)
    # make some greedy drafts match the argmax so that acceptance chains happen
    start = 0
    dstart = 0
    am = logits.argmax(-1).cpu()
    for r, k in enumerate(ks):
        for j in range(k):
            if greedy[r] and torch.rand((), generator=g) < 0.7:
                drafts[dstart + j] = am[start + j]
        start += k + 1
        dstart += k
    u = torch.rand(sum(ks), generator=g).to(DEVICE)
    noise = (-torch.log(torch.rand((len(ks), V), generator=g))).clamp_min(1e-30).to(DEVICE)
    return dict(
        p=p,
        logits=logits,
        drafts=drafts.to(DEVICE),
        ks=torch.tensor(ks),
        greedy=torch.tensor(greedy),
        q=q,
        u=u,
        noise=noise,
    )


def _both(b, **over):
    args = dict(
        target_probs=b["p"],
        target_logits=b["logits"],
        draft_token_ids=b["drafts"],
        num_draft_tokens=b["ks"],
        is_greedy=b["greedy"],
        draft_probs=b["q"],
        uniforms=b["u"],
        noise=b["noise"],
    )
    args.update(over)
    got = K.rejection_sample(**args)
    want = K.rejection_sample_reference(**args)
    return got, want


def _assert_same(got, want):
    assert torch.equal(got[1].cpu(), want[1].cpu()), (got[1], want[1])
    assert torch.equal(got[0].cpu(), want[0].cpu()), (got[0], want[0])


@pytest.mark.parametrize("V", [1000, 50277, 131072])
@pytest.mark.parametrize("with_q", [True, False])
def test_matches_twin_with_injected_randomness(V, with_q):
    g = gen()
    ks = [5, 0, 3, 5, 1, 0, 5, 2]
    greedy = [False, False, True, False, True, True, False, False]
    b = _batch(ks, V, g, greedy, with_q)
    _assert_same(*_both(b))


def test_greedy_ties_pick_the_first_index_and_bonus_when_all_accepted():
    g = gen()
    V = 500
    ks = [3, 3]
    b = _batch(ks, V, g, [True, True])
    logits = torch.zeros((8, V), device=DEVICE)
    logits[:, 7] = 1.0
    logits[:, 3] = 1.0  # tie with 7: argmax is 3
    b["logits"] = logits
    b["drafts"] = torch.tensor([3, 3, 3, 3, 7, 3], device=DEVICE)
    got, want = _both(b)
    _assert_same(got, want)
    toks, acc = got[0].cpu().tolist(), got[1].cpu().tolist()
    assert acc == [3, 1]
    assert toks[:4] == [3, 3, 3, 3]  # 3 accepted + bonus argmax
    assert toks[4:8] == [3, 3, -1, -1]  # first draft accepted, mismatch at the second -> argmax


def test_greedy_without_logits_uses_probs():
    g = gen()
    b = _batch([4, 2], 300, g, [True, True])
    _assert_same(*_both(b, target_logits=None))


def test_degenerate_acceptance_cases():
    g = gen()
    V = 64
    ks = [1, 1, 1, 1]
    b = _batch(ks, V, g, [False] * 4)
    p = b["p"].clone()
    q = b["q"].clone()
    d = torch.tensor([5, 6, 7, 8], device=DEVICE)
    # row 0: q(d) = 0 -> reject (u * 0 < p(d) is true only when p(d) > 0: make p(d) = 0 too)
    q[0, 5] = 0.0
    p[0, 5] = 0.0
    # row 1: p(d) = 0 -> reject
    p[2, 6] = 0.0
    # row 2: p == q -> always accept (a draft inside the support)
    p[4] = q[2]
    d[2] = int(q[2].argmax())
    # row 3: disjoint supports -> reject at position 0, token from p's support
    p[6] = 0.0
    p[6, :32] = 1.0 / 32
    q[3] = 0.0
    q[3, 32:] = 1.0 / 32
    d[3] = 40
    b.update(p=p, q=q, drafts=d)
    got, want = _both(b)
    _assert_same(got, want)
    acc = got[1].cpu().tolist()
    assert acc[0] == 0 and acc[1] == 0 and acc[2] == 1 and acc[3] == 0
    assert int(got[0][6]) < 32


def test_zero_residual_falls_back_to_p_and_padded_vocab_is_never_sampled():
    g = gen()
    V = 1000
    b = _batch([1, 2], V, g, [False, False])
    p = b["p"].clone()
    p[:, 900:] = 0.0
    p = p / p.sum(-1, keepdim=True)
    q = p[[0, 2, 3]].clone()  # p == q at every draft position
    b.update(p=p, q=q, drafts=torch.tensor([1, 2, 3], device=DEVICE))
    b["u"] = torch.ones(3, device=DEVICE)  # u = 1 forces a rejection although r = max(p - q, 0) = 0
    got, want = _both(b)
    _assert_same(got, want)
    assert got[1].cpu().tolist() == [0, 0]
    assert all(0 <= int(t) < 900 for t in got[0].cpu().tolist() if t >= 0)


def test_philox_streams_are_seeded_and_independent_per_row():
    g = gen()
    V = 4096
    ks = [3] * 16
    b = _batch(ks, V, g, [False] * 16)
    flat = torch.full_like(b["p"], 1.0 / V)
    b["p"] = flat
    args = dict(
        target_probs=flat,
        target_logits=None,
        draft_token_ids=b["drafts"],
        num_draft_tokens=b["ks"],
        is_greedy=b["greedy"],
        draft_probs=b["q"],
        seeds=torch.arange(16) + 11,
        offsets=torch.zeros(16, dtype=torch.int64),
    )
    a1 = K.rejection_sample(**args)
    a2 = K.rejection_sample(**args)
    assert torch.equal(a1[0], a2[0]) and torch.equal(a1[1], a2[1])
    args2 = dict(args, offsets=torch.ones(16, dtype=torch.int64))
    a3 = K.rejection_sample(**args2)
    assert not torch.equal(a1[0], a3[0])
    seeds = args["seeds"].clone()
    seeds[1:] += 1000  # other rows' seeds change: row 0 does not
    a4 = K.rejection_sample(**dict(args, seeds=seeds))
    assert torch.equal(a4[0][:4], a1[0][:4])


def _first_token_counts(p, q, n, V, g, seeds_base, mutate=None):
    """Emitted first tokens over n independent K=1 steps with drafts sampled from q."""
    P = p.to(DEVICE).expand(n * 2, V).contiguous()  # row r: positions 2r (verify), 2r + 1 (bonus)
    Qd = q.to(DEVICE).expand(n, V).contiguous()
    drafts = torch.multinomial(q.double(), n, replacement=True, generator=g).to(DEVICE)
    ks = torch.ones(n, dtype=torch.int64)
    if mutate is None:
        toks, _acc = K.rejection_sample(
            P,
            None,
            drafts,
            ks,
            torch.zeros(n, dtype=torch.bool),
            Qd,
            seeds=torch.arange(n) + seeds_base,
            offsets=torch.zeros(n, dtype=torch.int64),
        )
        first = toks.view(n, 2)[:, 0]
    else:
        first = mutate(p.to(DEVICE), q.to(DEVICE), drafts, n, g)
    return torch.bincount(first.cpu(), minlength=V)


def _mutant_recover_from_p(p, q, drafts, n, g):
    u = torch.rand(n, generator=g).to(DEVICE)
    acc = u * q[drafts] < p[drafts]
    e = -torch.log(torch.rand((n, p.numel()), generator=g)).to(DEVICE)
    rec = (p[None, :] / e).argmax(-1)  # WRONG: should be max(p - q, 0)
    return torch.where(acc, drafts, rec)


def test_emitted_tokens_follow_the_target_distribution():
    """Chi-square of the first emitted token against p (docs/kernel-design.md, "Statistical tests"),
    with a mutation check: the same harness rejects a sampler that recovers from p instead of
    max(p - q, 0)."""
    g = gen(1234)
    V = 32
    n = 200_000 if ON_GPU else 3_000
    p = _dirichlet(1, V, g, zeros=0.2)[0]
    q = _dirichlet(1, V, g, zeros=0.2)[0]
    counts = _first_token_counts(p, q, n, V, g, 7)
    assert chisquare_pvalue(counts, p) > 1e-4
    if ON_GPU:
        bad = _first_token_counts(p, q, n, V, g, 7, mutate=_mutant_recover_from_p)
        assert chisquare_pvalue(bad, p) < 1e-4


def test_acceptance_counts_are_truncated_geometric():
    g = gen(99)
    V, K_, n = 16, 3, (100_000 if ON_GPU else 2_000)
    p = _dirichlet(1, V, g)[0]
    q = _dirichlet(1, V, g)[0]
    alpha = float(torch.minimum(p, q).sum())
    P = p.to(DEVICE).expand(n * (K_ + 1), V).contiguous()
    Qd = q.to(DEVICE).expand(n * K_, V).contiguous()
    drafts = torch.multinomial(q.double(), n * K_, replacement=True, generator=g).to(DEVICE)
    _toks, acc = K.rejection_sample(
        P,
        None,
        drafts,
        torch.full((n,), K_),
        torch.zeros(n, dtype=torch.bool),
        Qd,
        seeds=torch.arange(n) + 5,
        offsets=torch.zeros(n, dtype=torch.int64),
    )
    counts = torch.bincount(acc.cpu(), minlength=K_ + 1)
    expected = torch.tensor([alpha**k * (1 - alpha) for k in range(K_)] + [alpha**K_], dtype=torch.float64)
    assert chisquare_pvalue(counts, expected) > 1e-4
