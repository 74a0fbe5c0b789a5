"""Rejection sampler: exact greedy verification and distribution preservation (chi-square)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from hybridserve.sampling.params import SamplingParams
from hybridserve.sampling.rejection import RejectionSampler
from hybridserve.sampling.row_params import RowParams
from hybridserve.sampling.sampler import RowSampling, Sampler
from sampling_stats import chisquare_pvalue

# Thresholds: a correct sampler passes at p > 1e-4 (fixed seeds make every run identical); the
# mutated samplers must be rejected far beyond chance (p < 1e-10).
PASS_P = 1e-4
FAIL_P = 1e-10


class NoCorrectionSampler(RejectionSampler):
    """Broken on purpose: after a rejection it samples from p instead of max(p - q, 0)."""

    def recovery_distribution(self, p, q, draft):
        return p


def dirichlet(shape: tuple[int, ...], gen: torch.Generator, zeros: int = 0) -> torch.Tensor:
    x = -torch.log(torch.rand(shape, generator=gen, dtype=torch.float64))  # Dirichlet(1) via Exp(1)
    if zeros:
        flat = x.reshape(-1, shape[-1])
        for row in flat:
            row[torch.randperm(shape[-1], generator=gen)[:zeros]] = 0.0
    return x / x.sum(-1, keepdim=True)


def log(p: torch.Tensor) -> torch.Tensor:
    return torch.log(p)  # log(0) = -inf: the token is impossible under the target


def draw(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.multinomial(probs, 1, generator=gen).squeeze(1)


def rows_random(n: int, **kw) -> list[RowSampling]:
    row = RowSampling(SamplingParams(**kw))
    return [row] * n


# ---------------------------------------------------------------------------------------------
# Greedy rows: exact.


@pytest.mark.parametrize("path", ["fast", "general"])
def test_greedy_rows_accept_while_draft_is_argmax(path: str):
    # "fast": plain greedy rows take the argmax-only path; "general": the same rows through
    # process_logits and the point-mass verification (as rows with a history to apply would)
    gen = torch.Generator().manual_seed(0)
    vocab, ks = 11, [0, 1, 3, 3, 5, 2]
    logits = torch.randn(sum(ks) + len(ks), vocab, generator=gen)
    logits[3, 7] = logits[3, 2] = logits[3].max() + 1  # a tie: the first index is the argmax
    argmax = logits.argmax(-1)
    drafts, expected, off = [], [], 0
    for r, k in enumerate(ks):
        # Row r: the first (r % (k + 1)) drafts match the argmax, the next one does not.
        n_ok = r % (k + 1)
        row_drafts = []
        for j in range(k):
            a = int(argmax[off + j])
            row_drafts.append(
                a
                if j < n_ok
                else (a + 1 + j) % vocab
                if j == n_ok
                else int(torch.randint(vocab, (1,), generator=gen))
            )
        drafts += row_drafts
        expected.append(row_drafts[:n_ok] + [int(argmax[off + n_ok])])
        off += k + 1
    rows = [RowSampling(SamplingParams(temperature=0.0)) for _ in ks]
    params = None
    if path == "general":  # (the rows' settings as a row with a history to apply has them)
        ones = np.ones(len(rows), dtype=bool)
        params = dataclasses.replace(RowParams.of(rows), plain_greedy=~ones, needs_history=ones)
    out = RejectionSampler().sample(logits, drafts, rows, ks, params=params)
    assert out.token_ids == expected
    assert out.num_accepted == [r % (k + 1) for r, k in enumerate(ks)]
    assert out.num_sampled == [len(t) for t in expected]


def test_greedy_rows_equal_sequential_greedy_with_penalties_and_mixed_batch():
    # A greedy verify row emits exactly what step-by-step greedy sampling would, given the same
    # logits at each position, including penalties that see the draft tokens as output.
    gen = torch.Generator().manual_seed(1)
    vocab, k = 9, 4
    params = SamplingParams(temperature=0.0, repetition_penalty=1.8, frequency_penalty=0.3)
    prompt, output = [1, 2, 3], [4]
    logits = torch.randn(k + 1, vocab, generator=gen)
    # Sequential reference and drafts that follow it for 2 tokens, then diverge.
    seq: list[int] = []
    for j in range(k + 1):
        row = RowSampling(params, prompt_token_ids=prompt, output_token_ids=output + seq)
        seq.append(int(Sampler().sample(logits[j : j + 1], [row]).token_ids[0]))
    drafts = seq[:2] + [(seq[2] + 1) % vocab, seq[3]]
    greedy_row = RowSampling(params, prompt_token_ids=prompt, output_token_ids=output)
    random_row = RowSampling(SamplingParams(temperature=1.0), seed=5)
    rand_logits = torch.randn(3, vocab, generator=gen)
    batch_logits = torch.cat([rand_logits, logits])
    out = RejectionSampler().sample(batch_logits, [0, 1] + drafts, [random_row, greedy_row], [2, k])
    assert out.token_ids[1] == seq[:3]
    alone = RejectionSampler().sample(logits, drafts, [greedy_row], [k])
    assert alone.token_ids[0] == seq[:3]
    # All drafts right: all accepted plus the bonus argmax.
    full = RejectionSampler().sample(logits, seq[:k], [greedy_row], [k])
    assert full.token_ids[0] == seq and full.num_accepted == [k]


@pytest.mark.parametrize("trial", range(6))
def test_random_rows_without_draft_probs_emit_what_step_by_step_sampling_emits(trial: int):
    # The point of keyed draws: a seeded random row verified against point-mass drafts emits
    # exactly the tokens that plain sampling one position at a time emits (given the same logits
    # at each position), penalties and truncation included, whether the drafts are right or not.
    gen = torch.Generator().manual_seed(100 + trial)
    vocab, k = 12, 4
    params = SamplingParams(
        temperature=0.8 + 0.1 * trial, top_k=6, top_p=0.95, repetition_penalty=1.3, seed=trial
    )
    prompt, output = [1, 2, 3], [4, 5][: trial % 3]
    logits = torch.randn(k + 1, vocab, generator=gen) * 1.5
    seq: list[int] = []
    for j in range(k + 1):
        row = RowSampling(params, seed=trial, prompt_token_ids=prompt, output_token_ids=output + seq)
        seq.append(int(Sampler().sample(logits[j : j + 1], [row]).token_ids[0]))
    verify_row = RowSampling(params, seed=trial, prompt_token_ids=prompt, output_token_ids=output)
    # All drafts right: all accepted plus the bonus token.
    full = RejectionSampler().sample(logits, seq[:k], [verify_row], [k])
    assert full.token_ids[0] == seq and full.num_accepted == [k]
    # First wrong draft at index a: a drafts accepted, then the step-by-step token a.
    for a in range(k):
        drafts = seq[:a] + [(seq[a] + 1 + trial) % vocab] + seq[a + 1 : k]
        out = RejectionSampler().sample(logits, drafts, [verify_row], [k])
        assert out.token_ids[0] == seq[: a + 1] and out.num_accepted == [a]
    # Drawing every position at once (what a GPU does) gives the same tokens.
    every = RejectionSampler(draw_all_positions=True)
    for a in range(k):
        drafts = seq[:a] + [(seq[a] + 1 + trial) % vocab] + seq[a + 1 : k]
        assert every.sample(logits, drafts, [verify_row], [k]).token_ids[0] == seq[: a + 1]
    # In a batch with other rows (greedy, unseeded random) the row's tokens do not change.
    other_greedy = RowSampling(SamplingParams(temperature=0.0))
    other_random = RowSampling(SamplingParams(temperature=1.0))
    batch_logits = torch.cat(
        [torch.randn(2, vocab, generator=gen), logits, torch.randn(3, vocab, generator=gen)]
    )
    out = RejectionSampler().sample(
        batch_logits, [0] + seq[:k] + [1, 2], [other_greedy, verify_row, other_random], [1, k, 2]
    )
    assert out.token_ids[1] == seq


def test_zero_drafts_draws_like_the_plain_sampler():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 30, generator=gen)
    params = [SamplingParams(temperature=0.8, top_k=10, seed=s) for s in range(5)]

    def rows() -> list[RowSampling]:
        return [RowSampling(p, seed=p.seed) for p in params]

    plain = Sampler().sample(logits, rows()).token_ids.tolist()
    verify = RejectionSampler().sample(logits, [], rows(), [0] * 5)
    assert verify.token_ids == [[t] for t in plain]


def test_seeded_rows_reproducible_and_logprobs_per_emitted_token():
    gen = torch.Generator().manual_seed(3)
    vocab, ks = 20, [3, 2]
    logits = torch.randn(sum(ks) + 2, vocab, generator=gen)
    drafts = torch.randint(vocab, (sum(ks),), generator=gen)

    def run() -> object:
        rows = [
            RowSampling(SamplingParams(seed=7, logprobs=2), seed=7),
            RowSampling(SamplingParams(seed=8), seed=8),
        ]
        return RejectionSampler().sample(logits, drafts, rows, ks)

    a, b = run(), run()
    assert a.token_ids == b.token_ids
    assert a.logprobs[1] is None
    lps = a.logprobs[0]
    assert lps is not None and len(lps) == len(a.token_ids[0])
    raw = torch.log_softmax(logits, -1)
    for j, (tok, entry) in enumerate(zip(a.token_ids[0], lps)):
        assert entry[tok].logprob == pytest.approx(float(raw[j, tok]), abs=1e-5)
        assert len(entry) in (2, 3)


def test_per_row_form_equals_flat_form():
    gen = torch.Generator().manual_seed(4)
    vocab, ks = 13, [2, 0, 3]
    logits = torch.randn(sum(ks) + 3, vocab, generator=gen)
    drafts = torch.randint(vocab, (sum(ks),), generator=gen).tolist()
    q = torch.softmax(torch.randn(sum(ks), vocab, generator=gen), -1)

    def rows() -> list[RowSampling]:
        return [RowSampling(SamplingParams(seed=i), seed=i) for i in range(3)]

    flat = RejectionSampler().sample(logits, drafts, rows(), ks, draft_probs=q)
    blocks = list(torch.split(logits, [k + 1 for k in ks]))
    per_drafts = [drafts[0:2], [], drafts[2:5]]
    per_q = list(torch.split(q, ks))
    per_row = RejectionSampler().sample(blocks, per_drafts, rows(), draft_probs=per_q)
    assert per_row.token_ids == flat.token_ids
    assert [per_row[i] for i in range(len(per_row))] == flat.token_ids


def test_fused_op_path_gives_the_same_tokens(monkeypatch: pytest.MonkeyPatch):
    # With draft probabilities, use_kernel=True goes through kernels.dispatch.rejection_sample (its
    # torch twin on the CPU), fed with the same uniforms and noise as the vectorised torch path:
    # identical tokens.
    gen = torch.Generator().manual_seed(6)
    vocab, ks = 17, [3, 0, 2, 4, 1, 3]
    logits = torch.randn(sum(ks) + len(ks), vocab, generator=gen) * 2
    drafts = torch.randint(vocab, (sum(ks),), generator=gen)
    q = torch.softmax(torch.randn(sum(ks), vocab, generator=gen), -1)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, seed=1),
        SamplingParams(temperature=1.0, top_k=5, seed=2),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=1.2, top_p=0.8, seed=3),
        SamplingParams(temperature=0.7, seed=4),
    ]
    from hybridserve.kernels import dispatch

    calls = []
    real = dispatch.rejection_sample

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(dispatch, "rejection_sample", counting)
    for trial in range(20):

        def rows(trial: int = trial) -> list[RowSampling]:
            return [RowSampling(p, seed=p.seed, prompt_token_ids=[1, 2], position=trial) for p in params]

        a = RejectionSampler(use_kernel=False).sample(logits, drafts, rows(), ks, draft_probs=q)
        b = RejectionSampler(use_kernel=True).sample(logits, drafts, rows(), ks, draft_probs=q)
        assert a.token_ids == b.token_ids
    assert len(calls) == 20


def test_zero_residual_falls_back_to_target():
    # Draft token impossible under both p and q: rejected, and max(p - q, 0) == 0 everywhere.
    p = torch.tensor([0.0, 0.5, 0.5, 0.0], dtype=torch.float64)
    n = 200
    logits = log(p)[None].repeat(2 * n, 1)
    q = p[None].repeat(n, 1)
    out = RejectionSampler().sample(
        logits, [0] * n, rows_random(n), [1] * n, draft_probs=q, generator=torch.Generator().manual_seed(0)
    )
    assert all(t[0] in (1, 2) and len(t) == 1 for t in out.token_ids)


def test_rejects_bad_shapes():
    with pytest.raises(ValueError):
        RejectionSampler().sample(torch.zeros(3, 4), [1], rows_random(1), [1])
    with pytest.raises(ValueError):
        RejectionSampler().sample(torch.zeros(2, 4), [9], rows_random(1), [1])


# ---------------------------------------------------------------------------------------------
# Random rows: the emitted tokens have the target distribution.


def first_token_counts(sampler: RejectionSampler, p, p_next, q, n: int, seed: int, with_probs: bool):
    gen = torch.Generator().manual_seed(seed)
    vocab = p.shape[0]
    # Drafts come from q in both cases; without draft probs the sampler is not told q (n-gram).
    drafts = draw(q[None].expand(n, vocab), gen)
    logits = torch.stack([log(p), log(p_next)])[None].expand(n, 2, vocab).reshape(2 * n, vocab)
    out = sampler.sample(
        logits,
        drafts,
        rows_random(n),
        [1] * n,
        draft_probs=q[None].expand(n, vocab) if with_probs else None,
        generator=torch.Generator().manual_seed(seed + 1),
    )
    first = torch.tensor([t[0] for t in out.token_ids])
    return torch.bincount(first, minlength=vocab), out


@pytest.fixture(scope="module")
def pq16() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    p = dirichlet((16,), gen, zeros=3)
    q = dirichlet((16,), gen, zeros=3)
    p_next = dirichlet((16,), gen)
    return p, q, p_next


def test_first_token_distribution_with_draft_probs(pq16):
    p, q, p_next = pq16
    n = 100_000
    counts, out = first_token_counts(RejectionSampler(), p, p_next, q, n, seed=10, with_probs=True)
    assert chisquare_pvalue(counts, p) > PASS_P
    # Acceptance rate is sum(min(p, q)) (binomial, 6 sigma).
    alpha = float(torch.minimum(p, q).sum())
    rate = sum(out.num_accepted) / n
    assert abs(rate - alpha) < 6 * (alpha * (1 - alpha) / n) ** 0.5
    # The same test catches a sampler that skips the recovered-token correction.
    bad, _ = first_token_counts(NoCorrectionSampler(), p, p_next, q, n, seed=10, with_probs=True)
    assert chisquare_pvalue(bad, p) < FAIL_P


@pytest.mark.parametrize("all_at_once", [False, True])
def test_first_token_distribution_without_draft_probs(pq16, all_at_once: bool):
    p, q, p_next = pq16
    n = 100_000
    sampler = RejectionSampler(draw_all_positions=all_at_once)
    counts, out = first_token_counts(sampler, p, p_next, q, n, seed=20, with_probs=False)
    assert chisquare_pvalue(counts, p) > PASS_P
    # A draft is accepted with probability p(draft): on average sum(q * p).
    alpha = float((p * q).sum())
    rate = sum(out.num_accepted) / n
    assert abs(rate - alpha) < 6 * (alpha * (1 - alpha) / n) ** 0.5


def test_drafts_drawn_with_the_requests_own_noise_do_not_bias_the_recovery(pq16):
    # A proposer that samples its drafts through the plain sampler with the request's own seed
    # uses the noise of (seed, position); the recovered token must not reuse it.
    p, q, p_next = pq16
    n = 40_000
    rows = [RowSampling(SamplingParams(temperature=1.0), seed=i) for i in range(n)]
    drafts = Sampler().sample(log(q)[None].expand(n, 16), rows).token_ids
    logits = torch.stack([log(p), log(p_next)])[None].expand(n, 2, 16).reshape(2 * n, 16)
    out = RejectionSampler().sample(logits, drafts, rows, [1] * n, draft_probs=q[None].expand(n, 16))
    first = torch.bincount(torch.tensor([t[0] for t in out.token_ids]), minlength=16)
    assert chisquare_pvalue(first, p) > PASS_P


def test_target_params_are_applied_before_acceptance(pq16):
    # With temperature and top-k, the emitted first token follows the processed target.
    p, q, p_next = pq16
    n = 100_000
    params = dict(temperature=0.6, top_k=6)
    gen = torch.Generator().manual_seed(30)
    drafts = draw(q[None].expand(n, 16), gen)
    logits = torch.stack([log(p), log(p_next)])[None].expand(n, 2, 16).reshape(2 * n, 16)
    out = RejectionSampler().sample(
        logits,
        drafts,
        rows_random(n, **params),
        [1] * n,
        draft_probs=q[None].expand(n, 16),
        generator=torch.Generator().manual_seed(31),
    )
    from hybridserve.sampling.sampler import processed_probs

    target = processed_probs(log(p)[None], rows_random(1, **params))[0]
    counts = torch.bincount(torch.tensor([t[0] for t in out.token_ids]), minlength=16)
    assert chisquare_pvalue(counts, target) > PASS_P
    assert chisquare_pvalue(counts, p) < FAIL_P


def test_accepted_count_is_truncated_geometric(pq16):
    p, q, _ = pq16
    n, k = 100_000, 3
    gen = torch.Generator().manual_seed(40)
    drafts = draw(q[None].expand(n * k, 16), gen)
    logits = log(p)[None].expand(n * (k + 1), 16)
    out = RejectionSampler().sample(
        logits,
        drafts,
        rows_random(n),
        [k] * n,
        draft_probs=q[None].expand(n * k, 16),
        generator=torch.Generator().manual_seed(41),
    )
    alpha = float(torch.minimum(p, q).sum())
    expected = torch.tensor([alpha**j * (1 - alpha) for j in range(k)] + [alpha**k], dtype=torch.float64)
    counts = torch.bincount(torch.tensor(out.num_accepted), minlength=k + 1)
    assert chisquare_pvalue(counts, expected) > PASS_P
    assert all(len(t) == a + 1 for t, a in zip(out.token_ids, out.num_accepted))


def two_token_counts(
    sampler: RejectionSampler, k: int, n: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Simulate speculative steps over explicit conditional tables (V = 4) until every row has
    2 tokens; returns the counts of the 16 two-token sequences and their exact probabilities."""
    v = 4
    tg = torch.Generator().manual_seed(999)
    p1, q1 = dirichlet((v,), tg, zeros=1), dirichlet((v,), tg, zeros=1)
    p2, q2 = dirichlet((v, v), tg), dirichlet((v, v), tg, zeros=1)
    p3 = dirichlet((v, v, v), tg)
    gen = torch.Generator().manual_seed(seed)
    sgen = torch.Generator().manual_seed(seed + 1)

    # Step 1 from the empty prefix: k drafts from q, verified against p.
    d1 = draw(q1[None].expand(n, v), gen)
    target = [log(p1)[None].expand(n, v), log(p2[d1])]
    qs = [q1[None].expand(n, v)]
    if k == 2:
        d2 = draw(q2[d1], gen)
        qs.append(q2[d1])
        target.append(log(p3[d1, d2]))
        draft_mat = torch.stack([d1, d2], 1)
    else:
        draft_mat = d1[:, None]
    logits = torch.stack(target, 1).reshape(n * (k + 1), v)
    dprobs = torch.stack(qs, 1).reshape(n * k, v)
    out = sampler.sample(
        logits, draft_mat.reshape(-1), rows_random(n), [k] * n, draft_probs=dprobs, generator=sgen
    )
    seqs = [t[:2] for t in out.token_ids]

    # Step 2 for rows that have one token so far: one draft from q2(.|x1).
    todo = [i for i, s in enumerate(seqs) if len(s) == 1]
    x1 = torch.tensor([seqs[i][0] for i in todo], dtype=torch.int64)
    m = len(todo)
    e1 = draw(q2[x1], gen)
    logits2 = torch.stack([log(p2[x1]), log(p3[x1, e1])], 1).reshape(2 * m, v)
    out2 = sampler.sample(logits2, e1, rows_random(m), [1] * m, draft_probs=q2[x1], generator=sgen)
    for i, t in zip(todo, out2.token_ids):
        seqs[i] = seqs[i] + [t[0]]
    cells = torch.tensor([a * v + b for a, b in seqs])
    exact = (p1[:, None] * p2).reshape(-1)
    return torch.bincount(cells, minlength=v * v), exact


@pytest.mark.parametrize("k", [1, 2])
def test_two_token_sequences(k: int):
    counts, exact = two_token_counts(RejectionSampler(), k, 80_000, seed=50 + k)
    assert chisquare_pvalue(counts, exact) > PASS_P
    bad, _ = two_token_counts(NoCorrectionSampler(), k, 80_000, seed=50 + k)
    assert chisquare_pvalue(bad, exact) < FAIL_P
