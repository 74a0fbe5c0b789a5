"""The integer seeds behind every random draw (pure Python: the server imports it without torch).

- `request_seed`: a request's own `seed`, else one derived from the engine's `--seed` and the
  request's arrival index (`derive_seed`), so unseeded requests are reproducible too;
- `choice_seed`: choice j of an `n > 1` request; choice 0 keeps the request's seed, the others get
  a mixed one, so that seed s choice 1 and seed s + 1 choice 0 do not share their draws (the
  offline `LLM` and the HTTP server use the same rule: same seed, same choices);
- `keyed_seed`: the generator seed of one draw, keyed by (request seed, output position, stream);
  the sampler draws every token from it (sampler.keyed_noise), which is what makes a seeded request
  independent of batching, caching, preemption and speculation.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1

# splitmix64's Weyl step and its finaliser's two multipliers; the step between a stream's draws
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
POSITION_STEP = 0xD1B54A32D192ED03

# Streams of keyed randomness: the exponentials of a token draw, and the acceptance uniforms of a
# verify step with draft probabilities. Distinct constants keep the streams independent.
NOISE_STREAM = 0x6E6F697365
UNIFORM_STREAM = 0x756E69666F726D
# The final draw of a verify step with draft probabilities (from the recovery or bonus
# distribution): its own stream, so that a proposer drafting with the request's plain noise at
# the same position cannot correlate with it.
RECOVERY_STREAM = 0x7265636F76657279
# Choice j > 0 of an n > 1 request: not derive_seed(seed, j), which is what the j-th unseeded
# request of an engine started with --seed `seed` gets.
CHOICE_STREAM = 0x63686F696365


def mix64(z: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that mixes every bit."""
    z = ((z ^ (z >> 30)) * MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * MIX2) & _MASK64
    return z ^ (z >> 31)


def derive_seed(base_seed: int, index: int) -> int:
    """A well-mixed 63-bit seed for the index-th child of `base_seed` (splitmix64)."""
    return mix64((base_seed * GOLDEN + (index + 1) * MIX1) & _MASK64) & _MASK63


def request_seed(seed: int | None, engine_seed: int, request_index: int) -> int:
    """The sampling seed of one request: its own `seed`, else one derived from (engine seed, index)."""
    return seed if seed is not None else derive_seed(engine_seed, request_index)


def choice_seed(seed: int | None, choice_index: int) -> int | None:
    """The seed of choice `choice_index` of a request seeded with `seed` (None stays None)."""
    if seed is None or choice_index == 0:
        return seed
    return keyed_seed(seed, choice_index, CHOICE_STREAM)


def keyed_seed(seed: int, position: int, stream: int) -> int:
    """The generator seed of draw `position` of `stream` for a request seeded with `seed`."""
    return keyed_from_base(stream_base(seed, stream), position)


def stream_base(seed: int, stream: int) -> int:
    """The part of `keyed_seed` that depends on the seed and the stream alone."""
    return mix64((seed * GOLDEN + stream) & _MASK64)


def keyed_from_base(base: int, position: int) -> int:
    """`keyed_seed` of draw `position`, from its `stream_base`."""
    return mix64((base + (position + 1) * POSITION_STEP) & _MASK64) & _MASK63
