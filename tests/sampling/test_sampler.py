"""Sampler: each parameter's effect, seeds, greedy, logprobs, and an exactness check of the draw."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hybridserve.sampling.params import SamplingParams
from hybridserve.sampling.sampler import (
    RowSampling,
    Sampler,
    keyed_noise,
    processed_probs,
)
from hybridserve.sampling.seeds import derive_seed, request_seed
from sampling_stats import chisquare_pvalue

P4 = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)


def rows_of(n: int, **kw) -> list[RowSampling]:
    return [RowSampling(SamplingParams(**kw)) for _ in range(n)]


def test_greedy_is_argmax_with_lowest_id_on_ties():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 50, generator=g)
    logits[3, 7] = logits[3, 11] = logits[3].max() + 1.0
    out = Sampler().sample(logits, rows_of(8, temperature=0.0))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.token_ids[3] == 7
    # A temperature below 1e-5 is greedy too, and greedy rows ignore top-k/top-p.
    out2 = Sampler().sample(logits, rows_of(8, temperature=1e-7, top_k=3, top_p=0.5))
    assert torch.equal(out2.token_ids, logits.argmax(dim=-1))
    probs = processed_probs(logits, rows_of(8, temperature=0.0))
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 50).to(probs.dtype))


def test_temperature_scales_the_distribution():
    logits = torch.log(P4)[None].repeat(3, 1)
    rows = [RowSampling(SamplingParams(temperature=t)) for t in (1.0, 2.0, 0.5)]
    probs = processed_probs(logits, rows)
    for i, t in enumerate((1.0, 2.0, 0.5)):
        assert torch.allclose(probs[i], torch.softmax(torch.log(P4) / t, dim=0), atol=1e-12)


def test_top_k_top_p_min_p_masks():
    logits = torch.log(P4)[None].repeat(5, 1)
    rows = [
        RowSampling(SamplingParams(top_k=2)),
        RowSampling(SamplingParams(top_p=0.75)),  # {0.5, 0.3} reaches 0.75
        RowSampling(SamplingParams(top_p=0.85)),  # needs 0.15 as well
        RowSampling(SamplingParams(min_p=0.2)),  # threshold 0.1 drops only 0.05
        RowSampling(SamplingParams(top_k=3, top_p=0.5)),  # top-p over the top-3 renormalised
    ]
    probs = processed_probs(logits, rows)
    assert torch.allclose(probs[0], torch.tensor([0.625, 0.375, 0, 0], dtype=torch.float64))
    assert torch.allclose(probs[1], torch.tensor([0.625, 0.375, 0, 0], dtype=torch.float64))
    assert torch.allclose(probs[2], torch.tensor([0.5, 0.3, 0.15, 0], dtype=torch.float64) / 0.95)
    assert torch.allclose(probs[3], torch.tensor([0.5, 0.3, 0.15, 0], dtype=torch.float64) / 0.95)
    # top-3 renormalised: 0.526, 0.316, 0.158 -> top_p 0.5 keeps the first only.
    assert torch.allclose(probs[4], torch.tensor([1.0, 0, 0, 0], dtype=torch.float64))
    # Sampled tokens never leave the support.
    big = torch.log(P4)[None].repeat(4000, 1)
    out = Sampler().sample(big, rows_of(4000, top_k=2), generator=torch.Generator().manual_seed(1))
    assert set(out.token_ids.tolist()) == {0, 1}


def test_top_p_always_keeps_the_most_likely_token():
    logits = torch.tensor([[5.0, 0.0, 0.0]])
    probs = processed_probs(logits, [RowSampling(SamplingParams(top_p=0.01))])
    assert probs[0].tolist() == [1.0, 0.0, 0.0]


def _top_p_kept_by_full_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The top-p rule from its definition, one row at a time over the whole sorted row: walking
    the tokens from the most likely, a token stays while the mass before it is below top_p; every
    token tied with the last one kept stays too."""
    kept = torch.zeros_like(probs, dtype=torch.bool)
    for i, row in enumerate(probs):
        values = row.sort(descending=True).values
        before = 0.0
        last = values[0]
        for v in values.tolist():
            if before >= top_p:
                break
            last, before = v, before + v
        kept[i] = row >= last
    return kept


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_top_p_keeps_the_set_its_definition_gives_however_few_tokens_reach_it(dtype):
    # Rows whose top-p mass sits in a few tokens, in hundreds, and spread over the whole
    # vocabulary (the partial sorts find the first kinds, a full sort the last), plus ties at
    # the boundary: each row keeps what the definition gives, alone or in any batch.
    from hybridserve.sampling.sampler import _descending_torch, _top_p_stages, _top_p_threshold

    def torch_threshold(probs: torch.Tensor, tp: torch.Tensor) -> torch.Tensor:
        # the accelerators' way (torch's top-k and sort), here on the CPU
        out = torch.empty_like(tp)
        _top_p_stages(probs, tp, out, _descending_torch)
        return out

    g = torch.Generator().manual_seed(3)
    vocab = 20000  # (at least 16 x 1024: both partial sorts are tried before a whole one)
    scales = [8.0, 4.0, 2.0, 0.5, 0.0]
    logits = torch.stack([torch.randn(vocab, generator=g, dtype=dtype) * s for s in scales])
    tied = torch.full((vocab,), -30.0, dtype=dtype)
    tied[:5] = 0.0  # five equal tokens of mass 0.2 each: top_p 0.5 keeps all five
    logits = torch.cat([logits, tied[None]])
    probs = torch.softmax(logits, dim=-1)
    for top_p in (0.3, 0.5, 0.9, 0.99):
        tp = torch.full((len(probs), 1), top_p, dtype=dtype)
        batch = probs >= _top_p_threshold(probs, tp)
        assert torch.equal(batch, _top_p_kept_by_full_sort(probs, top_p)), top_p
        assert torch.equal(probs >= torch_threshold(probs, tp), batch), top_p
        for i in range(len(probs)):  # the same set alone
            assert torch.equal(
                probs[i : i + 1] >= _top_p_threshold(probs[i : i + 1], tp[:1]), batch[i : i + 1]
            )
    sizes = (probs >= _top_p_threshold(probs, torch.full((len(probs), 1), 0.9, dtype=dtype))).sum(-1)
    assert sizes[0] < 64 < sizes[1] < 1024 < sizes[2], sizes  # each way to the boundary taken
    assert int(sizes[5]) == 5


def test_top_k_keeps_the_k_largest_without_sorting_the_row():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 2000, generator=g)
    rows = [RowSampling(SamplingParams(top_k=k)) for k in (1, 2, 50, 1999, 2000, 0)]
    probs = processed_probs(logits, rows)
    for i, k in enumerate((1, 2, 50, 1999, 2000, 2000)):
        top = logits[i].topk(k).indices
        assert set(probs[i].nonzero().squeeze(1).tolist()) == set(top.tolist())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_keyed_exponentials_are_exp1_and_the_same_from_numpy_and_torch_arithmetic(dtype):
    # The CPU draws them with numpy, an accelerator with torch's int64 arithmetic: the same
    # random bits, so the same draws up to the last bit of the logarithm.
    from hybridserve.sampling.sampler import _exponentials_torch, keyed_exponentials

    cpu = torch.device("cpu")
    keys = [0, 1, 2**62 + 12345, 2**63 - 1, 987654321987]
    a = keyed_exponentials(keys, 700, dtype, cpu)
    b = _exponentials_torch(keys, 700, dtype, cpu)
    assert a.dtype == b.dtype == dtype
    torch.testing.assert_close(a, b, rtol=4 * torch.finfo(dtype).eps, atol=0.0)
    # a column depends on (key, token) alone: a wider vocabulary extends the rows
    assert torch.equal(keyed_exponentials(keys[1:3], 1500, dtype, cpu)[:, :700], a[1:3])
    # a large vocabulary is drawn a few rows at a time: the same draws
    wide = keyed_exponentials(keys, 70000, dtype, cpu)
    assert torch.equal(wide[:, :700], a)
    assert bool((wide > 0).all()) and bool(torch.isfinite(wide).all())
    # Exp(1): mean 1, variance 1, P(E > 1) = 1/e (over 350k draws, 5 sigma bounds)
    flat = wide.double().flatten()
    assert abs(float(flat.mean()) - 1.0) < 0.01
    assert abs(float(flat.var()) - 1.0) < 0.02
    assert abs(float((flat > 1.0).double().mean()) - math.exp(-1.0)) < 0.005
    # neighbouring keys and tokens are not correlated
    assert abs(float(torch.corrcoef(torch.stack([wide[1].double(), wide[2].double()]))[0, 1])) < 0.03
    assert abs(float(torch.corrcoef(torch.stack([wide[1, :-1].double(), wide[1, 1:].double()]))[0, 1])) < 0.03


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_keyed_exponential_is_positive_and_finite_at_the_extreme_hashes(dtype):
    # u = 1 would give E = 0, a token that wins its race whatever its probability: the largest
    # hash must still give u < 1 (and the smallest u > 0), with numpy and with torch alike.
    import numpy as np

    from hybridserve.sampling.sampler import _exponentials_from_bits_np, _exponentials_from_bits_torch

    extremes = [0, 1, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1]
    a = _exponentials_from_bits_np(np.asarray(extremes, dtype=np.uint64), dtype == torch.float64)
    b = _exponentials_from_bits_torch(
        torch.as_tensor([e - 2**64 if e >= 2**63 else e for e in extremes], dtype=torch.int64), dtype
    )
    for e in (torch.from_numpy(a), b):
        assert bool((e > 0).all()) and bool(torch.isfinite(e).all()), e
    torch.testing.assert_close(torch.from_numpy(a).to(dtype), b, rtol=4 * torch.finfo(dtype).eps, atol=0.0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_top_p_below_the_dtypes_smallest_value_keeps_the_most_likely_token(dtype):
    from hybridserve.sampling.sampler import _descending_torch, _top_p_stages

    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(9), dtype=dtype)
    rows = [RowSampling(SamplingParams(top_p=1e-300))] * 3
    probs = processed_probs(logits, rows)
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal((probs > 0).sum(-1), torch.ones(3, dtype=torch.int64))
    # the accelerators' way too (a top_p of 0 in the dtype)
    p = torch.softmax(logits, -1)
    out = torch.empty((3, 1), dtype=dtype)
    _top_p_stages(p, torch.zeros((3, 1), dtype=dtype), out, _descending_torch)
    assert torch.equal(out[:, 0], p.max(-1).values)


def test_penalty_counts_kept_across_steps_equal_a_recount():
    # The engine keeps one row per request and extends its output list in place; the row keeps
    # its counts and adds the new tokens each step. Every step must equal a fresh row's recount,
    # with drafts (extra tokens) on top, repeats, and ids outside the vocabulary ignored.
    g = torch.Generator().manual_seed(5)
    vocab = 60
    params = SamplingParams(
        temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2
    )
    output: list[int] = []
    kept = RowSampling(params, seed=3, prompt_token_ids=[1, 2, 2, 59, 200], output_token_ids=output)
    for step in range(12):
        output.extend(int(t) for t in torch.randint(0, vocab, (step % 3,), generator=g))
        logits = torch.randn(3, vocab, generator=g, dtype=torch.float64)
        extra = [[], [7], [7, 7, 41]]
        fresh = RowSampling(
            params, seed=3, prompt_token_ids=[1, 2, 2, 59, 200], output_token_ids=list(output)
        )
        got = processed_probs(logits, [kept], row_index=[0, 0, 0], extra_tokens=extra)
        want = processed_probs(logits, [fresh], row_index=[0, 0, 0], extra_tokens=extra)
        assert torch.equal(got, want), step
    assert kept.penalty_history is not None and kept.penalty_history.counted == len(output)
    # a row given another output list, or another prompt, counts that one
    kept.output_token_ids = [9, 9]
    fresh = RowSampling(params, seed=3, prompt_token_ids=[1, 2, 2, 59, 200], output_token_ids=[9, 9])
    logits = torch.randn(1, vocab, generator=g, dtype=torch.float64)
    assert torch.equal(processed_probs(logits, [kept]), processed_probs(logits, [fresh]))
    kept.prompt_token_ids = [30, 31]
    fresh = RowSampling(params, seed=3, prompt_token_ids=[30, 31], output_token_ids=[9, 9])
    assert torch.equal(processed_probs(logits, [kept]), processed_probs(logits, [fresh]))


def test_repetition_penalty_over_prompt_and_output():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0, 1.0]])
    row = RowSampling(
        SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt_token_ids=[0, 1], output_token_ids=[3]
    )
    from hybridserve.sampling.sampler import process_logits

    pen = process_logits(logits, [row]).penalized[0]
    assert pen.tolist() == [1.0, -4.0, 2.0, -4.0, 1.0, 1.0]
    # Greedy then follows the penalised logits: token 2 wins over the penalised token 0.
    assert Sampler().sample(logits, [row]).token_ids.tolist() == [2]


def test_frequency_and_presence_penalties_over_output_only():
    from hybridserve.sampling.sampler import process_logits

    logits = torch.zeros(1, 5)
    row = RowSampling(
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        prompt_token_ids=[4, 4, 4],
        output_token_ids=[1, 1, 1, 2],
    )
    pen = process_logits(logits, [row]).penalized[0]
    assert pen.tolist() == [0.0, -1.75, -0.75, 0.0, 0.0]
    # extra_tokens (draft context in verification) count as output.
    pen2 = process_logits(logits, [row], extra_tokens=[[3]]).penalized[0]
    assert pen2.tolist() == [0.0, -1.75, -0.75, -0.75, 0.0]
    # Negative penalties encourage.
    row_neg = RowSampling(SamplingParams(presence_penalty=-1.0), output_token_ids=[0])
    assert process_logits(logits, [row_neg]).penalized[0, 0].item() == 1.0


def test_min_tokens_masks_stop_tokens():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    early = RowSampling(params, output_token_ids=[0], eos_token_id=1)
    assert Sampler().sample(logits, [early]).token_ids.tolist() == [3]
    done = RowSampling(params, output_token_ids=[0, 0], eos_token_id=1)
    assert Sampler().sample(logits, [done]).token_ids.tolist() == [1]
    ignore = RowSampling(
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2], ignore_eos=True), eos_token_id=1
    )
    assert Sampler().sample(logits, [ignore]).token_ids.tolist() == [1]
    probs = processed_probs(logits, [RowSampling(SamplingParams(min_tokens=1), eos_token_id=1)])
    assert probs[0, 1].item() == 0.0 and probs[0].sum().item() == pytest.approx(1.0)


def test_seeded_rows_are_reproducible_whatever_the_batch():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 64, generator=g)

    def run(order: list[int], seeds: list[int], position: int = 0) -> list[int]:
        rows = [RowSampling(SamplingParams(top_k=20), seed=seeds[i], position=position) for i in order]
        return Sampler().sample(logits[order], rows).token_ids.tolist()

    seeds = [11, 12, 13, 14, 15, 16]
    a = run([0, 1, 2, 3, 4, 5], seeds)
    b = run([5, 3, 1], seeds)
    assert [a[5], a[3], a[1]] == b
    assert run([0, 1, 2, 3, 4, 5], seeds) == a
    # The draw is keyed by the output position: later tokens of the same requests see other noise.
    draws = {tuple(run([0, 1, 2, 3, 4, 5], seeds, position=n)) for n in range(5)}
    assert len(draws) > 1
    # And by the seed.
    assert run([0, 1, 2, 3, 4, 5], [s + 100 for s in seeds]) != a


def test_noise_is_keyed_by_seed_and_output_position():
    # The position is len(output_token_ids) unless given: the history itself does not matter.
    a = RowSampling(SamplingParams(), seed=5, output_token_ids=[9, 9, 9])
    b = RowSampling(SamplingParams(), seed=5, position=3)
    assert a.noise_key == b.noise_key == (5, 3)
    assert RowSampling(SamplingParams()).noise_key is None
    n1 = keyed_noise([(5, 3), (5, 4), (6, 3)], 32, torch.float64, torch.device("cpu"))
    n2 = keyed_noise([(6, 3), (5, 3)], 32, torch.float64, torch.device("cpu"))
    assert torch.equal(n1[0], n2[1]) and torch.equal(n1[2], n2[0])
    assert not torch.equal(n1[0], n1[1]) and not torch.equal(n1[0], n1[2])
    assert bool((n1 > 0).all())
    # Exp(1): mean 1 over many keys (power: uniform noise has mean 1/2).
    many = keyed_noise([(7, i) for i in range(200)], 256, torch.float64, torch.device("cpu"))
    assert abs(float(many.mean()) - 1.0) < 0.02


def test_keyed_draws_use_the_whole_key():
    # torch's CPU generator keeps 32 bits of a seed; keys that differ above bit 31 must still give
    # other draws (else two positions of a long request could share their noise)
    from hybridserve.sampling.sampler import _keyed_draws

    cpu = torch.device("cpu")
    for kind in ("exponential", "uniform"):
        a = _keyed_draws(12345, 64, kind, torch.float64, cpu)
        assert torch.equal(a, _keyed_draws(12345, 64, kind, torch.float64, cpu))
        assert not torch.equal(a, _keyed_draws(12345 + 2**32, 64, kind, torch.float64, cpu))
        assert not torch.equal(a, _keyed_draws(12345 + 2**62, 64, kind, torch.float64, cpu))


def test_unseeded_requests_derive_their_seed_from_engine_seed_and_index():
    assert derive_seed(0, 0) == derive_seed(0, 0)
    assert len({derive_seed(0, i) for i in range(1000)}) == 1000
    assert derive_seed(1, 5) != derive_seed(0, 5)
    assert request_seed(None, 7, 3) == request_seed(None, 7, 3) == derive_seed(7, 3)
    assert request_seed(42, 7, 3) == 42
    # choice j of a request seeded s is not the j-th unseeded request of an engine seeded s
    from hybridserve.sampling.seeds import choice_seed

    assert choice_seed(0, 0) == 0 and choice_seed(None, 3) is None
    assert all(choice_seed(s, j) != derive_seed(s, j) for s in (0, 1, 7) for j in range(1, 5))
    assert len({choice_seed(s, j) for s in range(20) for j in range(5)}) == 100


def test_keyed_draws_follow_the_processed_distribution():
    # Every (seed, position) key is a fresh draw: one row per key gives the distribution.
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(12, generator=g) * 2
    n = 20000
    rows = [
        RowSampling(SamplingParams(temperature=0.7, top_k=8), seed=i // 50, position=i % 50) for i in range(n)
    ]
    out = Sampler().sample(logits[None].repeat(n, 1), rows)
    target = processed_probs(logits[None], rows[:1])[0]
    counts = torch.bincount(out.token_ids, minlength=12)
    assert chisquare_pvalue(counts, target) > 1e-4
    assert chisquare_pvalue(counts, torch.softmax(logits.double() / 0.7, 0)) < 1e-6


def test_draws_follow_the_processed_distribution():
    # Exactness of the exponential race, with temperature and top-k applied: chi-square.
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(12, generator=g) * 2
    n = 40000
    rows = rows_of(n, temperature=0.7, top_k=8)
    out = Sampler().sample(logits[None].repeat(n, 1), rows, generator=torch.Generator().manual_seed(6))
    target = processed_probs(logits[None], rows[:1])[0]
    counts = torch.bincount(out.token_ids, minlength=12)
    assert chisquare_pvalue(counts, target) > 1e-4
    # The test has power: the untruncated distribution is rejected.
    assert chisquare_pvalue(counts, torch.softmax(logits.double() / 0.7, 0)) < 1e-6


def test_logprobs_raw_and_processed():
    logits = torch.log(P4.float())[None].repeat(2, 1)
    rows = [
        RowSampling(
            SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=3.0), prompt_token_ids=[0]
        ),
        RowSampling(SamplingParams(temperature=0.0)),
    ]
    out = Sampler().sample(logits, rows)
    assert out.logprobs[1] is None
    lp = out.logprobs[0]
    assert lp is not None
    chosen = int(out.token_ids[0])
    assert chosen == 1  # token 0 is penalised (log 0.5 * 3 < log 0.3)
    # Raw mode: the model's own log-softmax, chosen token first, then the top 2.
    assert list(lp) == [1, 0]
    assert lp[1].logprob == pytest.approx(math.log(0.3), abs=1e-6) and lp[1].rank == 2
    assert lp[0].logprob == pytest.approx(math.log(0.5), abs=1e-6) and lp[0].rank == 1
    proc = Sampler(logprobs_mode="processed").sample(
        logits[:1],
        [RowSampling(SamplingParams(top_k=2, logprobs=0), seed=0)],
    )
    entry = proc.logprobs[0]
    assert entry is not None and len(entry) == 1
    ((tok, val),) = entry.items()
    assert val.logprob == pytest.approx(math.log([0.625, 0.375][tok]), abs=1e-6)


def test_float64_logits_stay_float64():
    logits = torch.randn(2, 10, dtype=torch.float64)
    probs = processed_probs(logits, rows_of(2))
    assert probs.dtype == torch.float64


def test_plain_greedy_batch_equals_the_processed_path():
    # A batch of plain greedy rows skips logit processing; a penalised greedy row does not.
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 40, generator=g)
    plain = Sampler().sample(logits, rows_of(6, temperature=0.0))
    assert plain.token_ids.dtype == torch.int64 and plain.logprobs == [None] * 6
    assert torch.equal(plain.token_ids, logits.argmax(dim=-1))
    logits[0, 5], logits[0, 9] = logits[0].max() + 1.0, logits[0].max() + 0.5
    rows = rows_of(6, temperature=0.0)
    rows[0] = RowSampling(SamplingParams(temperature=0.0, presence_penalty=2.0), output_token_ids=[5])
    mixed = Sampler().sample(logits, rows)
    assert int(mixed.token_ids[0]) == 9 and torch.equal(mixed.token_ids[1:], plain.token_ids[1:])


def test_argmax_rows_is_torch_argmax_with_ties_nan_and_infinities() -> None:
    # The sampler takes numpy's argmax on the CPU (faster than torch's there): the same index for
    # every row, the first of equal values, the first NaN, in float32 and float64, strided too.
    from hybridserve.sampling.sampler import argmax_rows

    rng = np.random.default_rng(0)
    for _ in range(500):
        n, v = int(rng.integers(1, 9)), int(rng.integers(1, 60))
        x = rng.integers(-3, 4, size=(n, v)).astype(rng.choice([np.float32, np.float64]))
        for special in (np.nan, np.inf, -np.inf):
            x[rng.random((n, v)) < 0.1] = special
        t = torch.from_numpy(x)
        if rng.random() < 0.3:
            t = t[:, ::2]
        got = argmax_rows(t)
        assert got.dtype == torch.int64 and torch.equal(got, t.argmax(dim=-1))
    half = torch.randn(3, 7).to(torch.bfloat16)  # (torch's own argmax)
    assert torch.equal(argmax_rows(half), half.argmax(dim=-1))
