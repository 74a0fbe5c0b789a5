"""OpenAI's logit_bias (SamplingParams.logit_bias): added to the raw logits of its row before any
other processing, greedy rows too, in the plain sampler and in the speculative verify path."""

from __future__ import annotations

import pytest
import torch

from hybridserve.errors import InvalidRequestError
from hybridserve.sampling.params import SamplingParams
from hybridserve.sampling.rejection import RejectionSampler
from hybridserve.sampling.sampler import RowSampling, Sampler, processed_probs

VOCAB = 16


def _logits(n: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn((n, VOCAB), generator=g, dtype=torch.float64) * 3


def test_plus_100_makes_greedy_pick_a_token_and_minus_100_forbids_it():
    logits = _logits()
    top = int(logits[0].argmax())
    low = int(logits[0].argmin())
    sampler = Sampler()
    pick = RowSampling(SamplingParams(temperature=0.0, logit_bias={low: 100}))
    assert int(sampler.sample(logits, [pick]).token_ids[0]) == low
    forbid = RowSampling(SamplingParams(temperature=0.0, logit_bias={top: -100}))
    second = int(logits[0].topk(2).indices[1])
    assert int(sampler.sample(logits, [forbid]).token_ids[0]) == second
    # a random row with -100 on the token that holds nearly all the mass never draws it
    peaked = torch.full((1, VOCAB), -5.0, dtype=torch.float64)
    peaked[0, 3] = 20.0
    rows = [RowSampling(SamplingParams(temperature=1.0, seed=s, logit_bias={3: -100})) for s in range(20)]
    toks = sampler.sample(peaked.expand(20, VOCAB), rows).token_ids.tolist()
    assert 3 not in toks


def test_rows_without_a_bias_are_unchanged_in_a_batch():
    logits = _logits(3)
    plain = [RowSampling(SamplingParams(temperature=0.7, seed=s)) for s in range(3)]
    biased = [plain[0], RowSampling(SamplingParams(temperature=0.7, seed=1, logit_bias={2: 50})), plain[2]]
    a = processed_probs(logits, plain)
    b = processed_probs(logits, biased)
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])
    assert not torch.equal(a[1], b[1])
    # the bias is exactly an addition to the raw logits
    shifted = logits.clone()
    shifted[1, 2] += 50
    assert torch.allclose(b[1], torch.softmax(shifted[1] / 0.7, dim=-1))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_verify_path_applies_the_same_bias(temperature):
    # every position of a verified row sees the bias: drafts equal to the biased sampler's own
    # choices are all accepted, and the bonus token is the biased one
    k = 3
    logits = _logits(k + 1)
    bias = {int(logits[j].argmin()): 100.0 for j in range(k + 1)}
    params = SamplingParams(temperature=temperature, seed=7, logit_bias=bias)
    sampler = Sampler()
    expected = []
    for j in range(k + 1):
        row = RowSampling(params, seed=7, output_token_ids=[0] * j)
        expected.append(int(sampler.sample(logits[j : j + 1], [row]).token_ids[0]))
    row = RowSampling(params, seed=7, output_token_ids=[])
    out = RejectionSampler().sample(logits, torch.tensor(expected[:k]), [row], num_draft_tokens=[k])
    assert out.num_accepted == [k]
    assert out.token_ids[0] == expected
    if temperature == 0.0:
        assert all(t in bias for t in expected)  # +100 wins every position
    # a draft that only the bias made likely is rejected without it
    unbiased = RowSampling(SamplingParams(temperature=temperature, seed=7), seed=7)
    plain = RejectionSampler().sample(logits, torch.tensor(expected[:k]), [unbiased], num_draft_tokens=[k])
    assert plain.num_accepted[0] < k


@pytest.mark.parametrize(
    "bias,word",
    [
        ({0: 100.5}, "in [-100, 100]"),
        ({0: float("nan")}, "in [-100, 100]"),
        ({-1: 1.0}, "non-negative"),
        ({"1": 1.0}, "non-negative"),
        ({0: True}, "numbers"),
        ({i: 0.0 for i in range(301)}, "at most 300"),
        ([(0, 1.0)], "mapping"),
    ],
)
def test_params_refuse_bad_biases_naming_the_field(bias, word):
    with pytest.raises(InvalidRequestError, match="logit_bias") as ei:
        SamplingParams(logit_bias=bias)
    assert word in str(ei.value)


def test_params_store_plain_numbers_and_an_empty_map_as_none():
    import numpy as np

    p = SamplingParams(logit_bias={np.int64(3): np.float32(2.5), 4: -1})
    assert p.logit_bias == {3: 2.5, 4: -1.0}
    assert all(type(t) is int and type(b) is float for t, b in p.logit_bias.items())
    assert SamplingParams(logit_bias={}).logit_bias is None
