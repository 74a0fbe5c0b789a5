"""The per-row sampling settings as arrays (`RowParams`): each entry is what the row's own object
says, the draw keys computed for all rows at once are `keyed_seed`'s, and the noise drawn from
them is `exponential_noise`'s, bit for bit."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hybridserve.sampling.params import SamplingParams
from hybridserve.sampling.row_params import RowParams, keyed_seeds, noise_base
from hybridserve.sampling.sampler import RowSampling, exponential_noise, row_noise
from hybridserve.sampling.seeds import NOISE_STREAM, keyed_seed


def random_rows(rng: random.Random, n: int, vocab: int = 50) -> list[RowSampling]:
    rows = []
    for _ in range(n):
        kw: dict = {"max_tokens": 50, "temperature": rng.choice([0.0, 1e-6, 0.5, 1.0])}
        if rng.random() < 0.5:
            kw["top_p"] = rng.choice([0.3, 0.9])
        if rng.random() < 0.5:
            kw["top_k"] = rng.choice([-1, 0, 3, 100])
        if rng.random() < 0.3:
            kw["min_p"] = 0.1
        if rng.random() < 0.2:
            kw["presence_penalty"] = 0.5
        if rng.random() < 0.2:
            kw["min_tokens"] = 3
        if rng.random() < 0.2:
            kw["logit_bias"] = {1: 2.0}
        if rng.random() < 0.2:
            kw["logprobs"] = 2
        if rng.random() < 0.15:
            kw["allowed_token_ids"] = [1, 2, 3]
        bad_word_ids = ((4,), (5, 6)) if rng.random() < 0.15 else ()
        seed = None if rng.random() < 0.3 else rng.choice([0, 2**63 - 1, rng.randrange(2**63)])
        output = [rng.randrange(vocab) for _ in range(rng.randint(0, 5))]
        rows.append(
            RowSampling(SamplingParams(**kw), seed=seed, output_token_ids=output, bad_word_ids=bad_word_ids)
        )
    return rows


def test_keyed_seeds_are_keyed_seed_of_every_row() -> None:
    rng = random.Random(0)
    seeds = [0, 1, 2**63 - 1] + [rng.randrange(2**63) for _ in range(200)]
    positions = [0, 1, 2**40] + [rng.randrange(1 << 20) for _ in range(200)]
    base = np.array([noise_base(s) for s in seeds], dtype=np.uint64)
    want = [keyed_seed(s, p, NOISE_STREAM) for s, p in zip(seeds, positions)]
    for n in (0, 1, 3, 4, 5, len(seeds)):  # (a few rows are mixed as Python integers)
        got = keyed_seeds(base[:n], np.array(positions[:n], dtype=np.int64))
        assert got.dtype == np.uint64 and got.tolist() == want[:n]


def test_row_params_hold_what_each_row_says() -> None:
    rows = random_rows(random.Random(1), 300)
    p = RowParams.of(rows)
    for i, row in enumerate(rows):
        q = row.params
        assert p.temperature[i] == q.temperature and p.top_p[i] == q.top_p and p.top_k[i] == q.top_k
        assert p.min_p[i] == q.min_p
        assert p.greedy[i] == row.greedy
        needs_history = row.has_penalties or q.min_tokens > 0 or bool(row.bad_word_ids)
        assert p.needs_history[i] == needs_history
        assert p.biased[i] == bool(q.logit_bias)
        banned = q.allowed_token_ids is not None or bool(row.bad_word_ids)
        assert p.banned[i] == banned
        assert p.plain_greedy[i] == (
            row.greedy and not needs_history and q.logprobs is None and not q.logit_bias and not banned
        )
        assert p.seeded[i] == (row.seed is not None)
        assert p.positions[i] == row.output_position
    # at least one row of each kind was checked
    assert p.plain_greedy.any() and not p.plain_greedy.all() and p.seeded.any() and not p.seeded.all()
    assert p.banned.any() and not p.banned.all()
    sub = p.take([5, 0, 5])
    assert sub.temperature.tolist() == [p.temperature[5], p.temperature[0], p.temperature[5]]
    empty = RowParams.of([])
    assert len(empty.greedy) == 0 and empty.noise_base.dtype == np.uint64


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_row_noise_is_exponential_noise_bit_for_bit(dtype: torch.dtype) -> None:
    rows = random_rows(random.Random(2), 40)
    p = RowParams.of(rows)
    keys = [r.noise_key for r in rows]
    want = exponential_noise(795, keys, torch.Generator().manual_seed(5), dtype, torch.device("cpu"))
    got = row_noise(p, 795, torch.Generator().manual_seed(5), dtype, torch.device("cpu"))
    assert torch.equal(want, got)
    seeded = [r for r in rows if r.seed is not None]
    want = exponential_noise(795, [r.noise_key for r in seeded], None, dtype, torch.device("cpu"))
    assert torch.equal(want, row_noise(RowParams.of(seeded), 795, None, dtype, torch.device("cpu")))


def test_params_for_other_rows_are_refused() -> None:
    from hybridserve.sampling.rejection import RejectionSampler
    from hybridserve.sampling.sampler import Sampler

    rows = random_rows(random.Random(3), 3)
    wrong = RowParams.of(rows[:2])
    with pytest.raises(ValueError, match="params has 2 rows for 3"):
        Sampler().sample(torch.zeros(3, 50), rows, params=wrong)
    with pytest.raises(ValueError, match="params has 2 rows for 3"):
        RejectionSampler().sample(torch.zeros(3, 50), [], rows, [0, 0, 0], params=wrong)
