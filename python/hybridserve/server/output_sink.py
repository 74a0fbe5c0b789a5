"""The outputs of one HTTP request's choices on their way to its handler."""

from __future__ import annotations

import asyncio
import collections
from typing import Any, Generic, TypeVar

from hybridserve.engine.outputs import RequestOutput, coalesce

C = TypeVar("C")


class OutputSink(Generic[C]):
    """(choice, item) pairs in arrival order; an item is a RequestOutput, an engine error, or a
    marker of the choice's end. A choice's outputs that the handler has not taken yet are merged
    into one (`coalesce`: their deltas joined), so that a client that reads a stream slower than the
    engine writes it, or not at all, leaves one pending output per choice here, not one per step
    (each a copy of the choice's tokens and logprobs so far: gigabytes for a large `n`)."""

    def __init__(self) -> None:
        self._items: collections.deque[tuple[C, Any]] = collections.deque()
        self._ready = asyncio.Event()
        self._taken = 0  # items taken so far: a position in the deque is (its number - _taken)
        self._last: dict[int, int] = {}  # id(choice) -> the number of its last item put

    def put_nowait(self, entry: tuple[C, Any]) -> None:
        choice, item = entry
        number = self._last.get(id(choice))
        if isinstance(item, RequestOutput) and number is not None and number >= self._taken:
            i = number - self._taken
            last = self._items[i][1]
            if isinstance(last, RequestOutput):
                merged = coalesce(last, item)
                if merged is not None:
                    self._items[i] = (choice, merged)
                    return
        self._last[id(choice)] = self._taken + len(self._items)
        self._items.append(entry)
        self._ready.set()

    async def get(self) -> tuple[C, Any]:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        self._taken += 1
        return self._items.popleft()
