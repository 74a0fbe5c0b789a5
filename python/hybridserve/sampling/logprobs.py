"""Log-probabilities of sampled tokens, as the sampler computes them and the outputs carry them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """Log-probability of one token, with its decoded text."""

    logprob: float
    rank: int
    decoded_token: str = ""


# One entry per generated token: token id -> Logprob (the chosen token plus the top-n).
TokenLogprobs = dict[int, Logprob]
