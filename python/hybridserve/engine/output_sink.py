"""Outputs on their way to their reader, merged for a reader that falls behind: one request's
(the async engine's stream) or one HTTP request's choices (the server's handler)."""

from __future__ import annotations

import asyncio
import collections
from typing import Any, Generic, TypeVar

from hybridserve.engine.outputs import RequestOutput, coalesce

C = TypeVar("C")

# A reader this many items behind on a choice has its next outputs merged into the last one. A
# reader keeping up gets one output per step (a token each, without speculation); one that falls
# behind (a client that does not read, a network slower than the engine) holds at most this many,
# not one per step: each is a copy of the tokens and logprobs so far.
MERGE_BEHIND = 8


class OutputSink(Generic[C]):
    """(choice, item) pairs in arrival order; an item is a RequestOutput, an engine error, or a
    marker of the choice's end. A choice whose handler is MERGE_BEHIND items behind has its next
    outputs merged into its last one (`coalesce`: their deltas joined), so that a client that reads
    a stream slower than the engine writes it, or not at all, leaves a few pending outputs per
    choice here, not one per step (each a copy of the choice's tokens and logprobs so far:
    gigabytes for a large `n`). A handler that keeps up gets every output as it came."""

    def __init__(self) -> None:
        self._items: collections.deque[tuple[C, Any]] = collections.deque()
        self._ready = asyncio.Event()
        self._taken = 0  # items taken so far: a position in the deque is (its number - _taken)
        self._last: dict[int, int] = {}  # id(choice) -> the number of its last item put
        self._pending: dict[int, int] = {}  # id(choice) -> its items not taken yet

    def put_nowait(self, entry: tuple[C, Any]) -> None:
        choice, item = entry
        key = id(choice)
        # (a choice with items pending has its last one still here)
        if isinstance(item, RequestOutput) and self._pending.get(key, 0) >= MERGE_BEHIND:
            i = self._last[key] - self._taken
            last = self._items[i][1]
            if isinstance(last, RequestOutput):
                merged = coalesce(last, item)
                if merged is not None:
                    self._items[i] = (choice, merged)
                    return
        self._last[key] = self._taken + len(self._items)
        self._pending[key] = self._pending.get(key, 0) + 1
        self._items.append(entry)
        self._ready.set()

    async def get(self) -> tuple[C, Any]:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        self._taken += 1
        entry = self._items.popleft()
        self._pending[id(entry[0])] -= 1
        return entry
