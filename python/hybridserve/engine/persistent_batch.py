"""The model runner's persistent batch: each request's sampling settings, kept in place across
steps.

A request takes a slot the first step it samples in, and its entries (`row_params.FIELDS`: the
temperature, truncation, which kind of row it is, the seed's part of its draw keys) are written
there once. Each step then gathers the slots of its rows as arrays (`RowParams`), one fancy index
per field, instead of reading every row's object for every setting. The updates are the
scheduler's deltas as the runner sees them:

- a new request is written into a free slot; a row object its slot does not hold (a request
  added again under the same id) is written over it;
- a finished or aborted request gives its slot back (`free`, from `ModelRunner.free_request`);
- a preempted request keeps its slot, and finds it again when it is scheduled back.

The rows' input arrays are not kept here: the Rust scheduler keeps each request's tokens, blocks
and state slots and writes the step's flat arrays (15-30 us at batch 64), which the native decode
step reads in place and the per-op forward wraps as tensors without a copy on the CPU (on an
accelerator they move in one copy: `model/batch.py` `HostStaging`).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import cast

import numpy as np

from hybridserve.sampling.row_params import FIELDS, RowParams, row_entries
from hybridserve.sampling.sampler import RowSampling

_output_position = operator.attrgetter("output_position")


class PersistentBatch:
    """Slots of sampling settings, one per request the runner samples (see the module docstring).
    The arrays grow by doubling and never shrink; a freed slot is reused."""

    def __init__(self, capacity: int = 64) -> None:
        self._slot_of: dict[str, int] = {}
        self._row_of_slot: list[RowSampling | None] = []  # the row object each slot was written from
        self._free: list[int] = []
        self._arrays: dict[str, np.ndarray] = {name: np.zeros(0, dtype=dtype) for name, dtype in FIELDS}
        self._grow(max(1, capacity))
        # The last step's rows and what was computed for them: a step whose rows are the same
        # requests, in the same order, with the same row objects (a batch of decode rows, step
        # after step) reuses its slots and gathered settings. Any slot written or freed since
        # drops them.
        self._last_ids: list[str] = []
        self._last_rows: list[RowSampling | None] = []
        self._last_slots: np.ndarray | None = None
        self._gathered: dict[str, np.ndarray] | None = None  # the fields at `_last_slots`

    def __len__(self) -> int:
        """Requests holding a slot."""
        return len(self._slot_of)

    @property
    def capacity(self) -> int:
        return len(self._row_of_slot)

    def slots(self, req_ids: Sequence[str], rows: Sequence[RowSampling | None]) -> np.ndarray:
        """The slot of each row (intp, read only; -1 where `rows[i]` is None: a request that is
        gone). A request without a slot, or whose slot holds another row object, is written
        first. The same array object as the last call's when the rows are the same."""
        last = self._last_slots
        if (
            last is not None
            and len(rows) == len(last)
            and all(map(operator.is_, rows, self._last_rows))
            and req_ids == self._last_ids
        ):
            return last
        found = list(map(self._slot_of.get, req_ids))
        slots = cast(list[int], found)
        if None in found or not all(map(operator.is_, map(self._row_of_slot.__getitem__, slots), rows)):
            slots = [-1 if row is None else self._place(rid, row) for rid, row in zip(req_ids, rows)]
        array = np.fromiter(slots, dtype=np.intp, count=len(slots))
        self._last_ids, self._last_rows, self._last_slots = list(req_ids), list(rows), array
        self._gathered = None
        return array

    def all_plain_greedy(self, slots: np.ndarray) -> bool:
        """Whether every row of `slots` is a request's, plain greedy (`RowParams.plain_greedy`)."""
        return bool((slots >= 0).all() and self._fields(slots)["plain_greedy"].all())

    def params(self, slots: np.ndarray, rows: Sequence[RowSampling]) -> RowParams:
        """The settings of `rows`, gathered from their `slots` (none -1). Its arrays are read
        only: those of the last `slots` array are kept and given again for it."""
        positions = np.fromiter(map(_output_position, rows), dtype=np.int64, count=len(rows))
        return RowParams(**self._fields(slots), positions=positions)

    def _fields(self, slots: np.ndarray) -> dict[str, np.ndarray]:
        """Every field at `slots` (kept for the last `slots()` array)."""
        if slots is not self._last_slots:
            return {name: a[slots] for name, a in self._arrays.items()}
        if self._gathered is None:
            self._gathered = {name: a[slots] for name, a in self._arrays.items()}
        return self._gathered

    def free(self, req_id: str) -> None:
        """The request is gone: its slot is free (nothing if it has none)."""
        slot = self._slot_of.pop(req_id, None)
        if slot is not None:
            self._row_of_slot[slot] = None
            self._free.append(slot)
            self._last_slots = self._gathered = None

    def _place(self, req_id: str, row: RowSampling) -> int:
        """The slot of `req_id`, written from `row` unless it already holds that row."""
        slot = self._slot_of.get(req_id)
        if slot is not None and self._row_of_slot[slot] is row:
            return slot
        if slot is None:
            if not self._free:
                self._grow(2 * self.capacity)
            slot = self._free.pop()
            self._slot_of[req_id] = slot
        self._row_of_slot[slot] = row
        for (name, _), value in zip(FIELDS, row_entries(row)):
            self._arrays[name][slot] = value
        self._last_slots = self._gathered = None
        return slot

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        for name, a in self._arrays.items():
            grown = np.zeros(capacity, dtype=a.dtype)
            grown[:old] = a
            self._arrays[name] = grown
        self._row_of_slot.extend([None] * (capacity - old))
        self._free.extend(range(capacity - 1, old - 1, -1))  # (popped from the end: lowest first)
