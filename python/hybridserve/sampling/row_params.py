"""The sampling parameters of a step's rows as arrays, one entry per row.

The sampler reads every per-row setting (temperature, truncation, which rows are greedy, the keys
of their draws) from these arrays, so a step costs array operations, not a pass over the rows'
objects for each setting. `RowParams.of(rows)` builds them from the rows; the model runner's
`PersistentBatch` keeps each request's entries across steps and gathers them instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hybridserve.sampling.seeds import MIX1, MIX2, NOISE_STREAM, POSITION_STEP, keyed_from_base, stream_base

if TYPE_CHECKING:
    from hybridserve.sampling.sampler import RowSampling


def mix64_array(z: np.ndarray) -> None:
    """`seeds.mix64` of every entry of the uint64 array `z`, in place (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= np.uint64(MIX1)
        z ^= z >> np.uint64(27)
        z *= np.uint64(MIX2)
        z ^= z >> np.uint64(31)


def noise_base(seed: int | None) -> int:
    """The part of a request's draw keys that depends on its seed alone (`seeds.stream_base` of
    the token draws' stream); 0 for an unseeded request."""
    return 0 if seed is None else stream_base(seed, NOISE_STREAM)


# Up to this many rows the keys are mixed as Python integers: eight numpy operations on a few
# elements cost more than the arithmetic itself (12 us for one row, against 1.5 us).
_FEW_ROWS = 4


def keyed_seeds(base: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """`seeds.keyed_seed(seed, position, NOISE_STREAM)` of every row at once (uint64), from the
    rows' `noise_base` (uint64) and output positions (int64)."""
    if len(base) <= _FEW_ROWS:
        few = [keyed_from_base(b, p) for b, p in zip(base.tolist(), positions.tolist())]
        return np.array(few, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = base + (positions.astype(np.uint64) + np.uint64(1)) * np.uint64(POSITION_STEP)
    mix64_array(z)
    keys: np.ndarray = z & np.uint64((1 << 63) - 1)
    return keys


# The fields of one row, in the order `row_entries` gives them and the arrays' dtypes.
FIELDS: tuple[tuple[str, type], ...] = (
    ("temperature", np.float64),
    ("top_p", np.float64),
    ("top_k", np.int64),
    ("min_p", np.float64),
    ("greedy", np.bool_),
    ("plain_greedy", np.bool_),
    ("needs_history", np.bool_),
    ("biased", np.bool_),
    ("banned", np.bool_),
    ("seeded", np.bool_),
    ("noise_base", np.uint64),
)


def row_entries(
    row: RowSampling,
) -> tuple[float, float, int, float, bool, bool, bool, bool, bool, bool, int]:
    """One row's values of `FIELDS`."""
    p = row.params
    greedy = row.greedy
    needs_history = row.has_penalties or p.min_tokens > 0 or bool(row.bad_word_ids)
    biased = bool(p.logit_bias)
    banned = p.allowed_token_ids is not None or bool(row.bad_word_ids)
    plain = greedy and not needs_history and p.logprobs is None and not biased and not banned
    return (
        float(p.temperature),
        float(p.top_p),
        int(p.top_k),
        float(p.min_p),
        greedy,
        plain,
        needs_history,
        biased,
        banned,
        row.seed is not None,
        noise_base(row.seed),
    )


@dataclass(frozen=True)
class RowParams:
    """Per-row sampling settings of a batch (numpy, one entry per row, in the rows' order).

    `positions` is each row's output position (`RowSampling.output_position`), which keys its
    draw together with `noise_base` where `seeded`."""

    temperature: np.ndarray  # float64
    top_p: np.ndarray  # float64
    top_k: np.ndarray  # int64 (0 or -1: off)
    min_p: np.ndarray  # float64
    greedy: np.ndarray  # bool
    plain_greedy: np.ndarray  # bool: greedy, nothing to apply before the argmax but a grammar mask
    needs_history: np.ndarray  # bool: a penalty, min_tokens or bad words (they read the output)
    biased: np.ndarray  # bool: a logit_bias
    banned: np.ndarray  # bool: allowed_token_ids or bad words
    seeded: np.ndarray  # bool
    noise_base: np.ndarray  # uint64
    positions: np.ndarray  # int64

    @staticmethod
    def of(rows: Sequence[RowSampling]) -> RowParams:
        """The arrays of `rows`, read from each row."""
        entries = [row_entries(r) for r in rows]
        columns = list(zip(*entries)) if entries else [()] * len(FIELDS)
        arrays: dict[str, np.ndarray] = {
            name: np.array(col, dtype=dtype) for (name, dtype), col in zip(FIELDS, columns)
        }
        positions = np.fromiter((r.output_position for r in rows), dtype=np.int64, count=len(rows))
        return RowParams(**arrays, positions=positions)

    def take(self, index: Sequence[int] | np.ndarray) -> RowParams:
        """The rows `index` (in that order)."""
        idx = np.asarray(index, dtype=np.intp)
        return RowParams(**{name: getattr(self, name)[idx] for name in _ALL})

    def noise_keys(self) -> np.ndarray:
        """The 63-bit key of each row's token draw (uint64; meaningless where not `seeded`)."""
        return keyed_seeds(self.noise_base, self.positions)


_ALL = (*(name for name, _ in FIELDS), "positions")
