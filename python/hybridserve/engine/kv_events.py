"""Publishing the scheduler's KV cache events over ZMQ in vLLM's wire format (docs/kv-events.md).

The engine loop hands each step's events to `KVEventPublisher.publish`, which only queues them;
a thread encodes and sends. Every message is three frames: the topic, an 8-byte big-endian
sequence number (0, 1, 2, ... per engine start) and a msgpack `EventBatch` array
`[ts, events, data_parallel_rank]` whose events are maps tagged by "type" ("BlockStored", "BlockRemoved",
"AllBlocksCleared"). With a replay endpoint, a ROUTER socket answers a request carrying a
starting sequence number with the buffered batches from there on, then an end marker.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

from hybridserve.config.kv_events import KVEventsConfig
from hybridserve.errors import ConfigError

logger = logging.getLogger(__name__)

#: The cache groups of the events: attention KV blocks, Mamba checkpoints.
GROUP_SPEC_KINDS = {0: "full_attention", 1: "mamba"}
#: The tier of every event: the engine's own cache in device memory (on a CPU-only engine too;
#: consumers keep "GPU" events as the serving tier and treat others as offloaded copies).
MEDIUM = "GPU"
#: End of a replay answer: sequence number -1 and an empty payload.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
# The batch's data_parallel_rank: an engine here is one vLLM data-parallel rank, rank 0 (replicas
# behind a router are separate engines, each publishing on its own endpoint)
DATA_PARALLEL_RANK = 0
REPLAY_SEND_TIMEOUT_MS = 5000  # a replay client that stops reading does not hold the thread longer

#: (kind, group, block id, parent id, token ids), as `Scheduler.take_kv_events` returns them.
RawEvent = tuple[str, int, int, int | None, list[int]]


def encode_event(e: RawEvent, block_size: int) -> dict[str, Any]:
    """One scheduler event as vLLM's tagged map."""
    kind, group, block_id, parent, tokens = e
    if kind == "stored":
        return {
            "type": "BlockStored",
            "block_hashes": [block_id],
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": block_size,
            "lora_id": None,
            "medium": MEDIUM,
            "lora_name": None,
            "group_idx": group,
            "kv_cache_spec_kind": GROUP_SPEC_KINDS[group],
        }
    if kind == "removed":
        return {"type": "BlockRemoved", "block_hashes": [block_id], "medium": MEDIUM, "group_idx": group}
    if kind == "cleared":
        return {"type": "AllBlocksCleared"}
    raise ValueError(f"unknown KV cache event kind {kind!r}")


class KVEventPublisher:
    """A PUB socket (and optional replay ROUTER socket) fed by a thread of its own."""

    def __init__(self, config: KVEventsConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        # (sequence number, time, events); max_queue_size 0 is unbounded, as Python's and vLLM's
        self._queue: queue.Queue[tuple[int, float, list[RawEvent]] | None] = queue.Queue(
            config.max_queue_size
        )
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket[bytes] | None = None
        field, address = "endpoint", config.endpoint
        try:
            if KVEventsConfig.binds(address):
                self._pub.bind(address)
            else:
                self._pub.connect(address)
            if config.replay_endpoint is not None:
                field, address = "replay_endpoint", config.replay_endpoint
                self._replay = self._ctx.socket(zmq.ROUTER)
                # a replay sends up to buffer_steps messages at once: at the default high-water
                # mark (1000) a ROUTER would drop the rest without a word and still send the end
                self._replay.setsockopt(zmq.SNDHWM, config.buffer_steps + 1)
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self._replay.setsockopt(zmq.SNDTIMEO, REPLAY_SEND_TIMEOUT_MS)
                self._replay.bind(address)
        except zmq.ZMQError as e:
            # the address the user gave cannot be opened here (taken, no such directory, no such
            # interface): their configuration, named by its field
            self._close_sockets()
            raise ConfigError(f"--kv-events-config: cannot open {field} {address}: {e}") from None
        self.batches_sent = 0
        self.batches_dropped = 0
        self.events_dropped = 0
        self._next_seq = 0  # (numbered as they are published: a dropped batch leaves its gap)
        self._encoder = msgspec.msgpack.Encoder()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[RawEvent]) -> None:
        """Queues one batch (one engine step's events) under the next sequence number; never
        blocks the engine loop. A full queue drops the batch, counted in `batches_dropped` and
        `events_dropped`: its number is skipped, so a subscriber sees the gap, as a slow
        subscriber does at the PUB socket's high-water mark."""
        if not events:
            return
        seq = self._next_seq
        self._next_seq += 1
        try:
            self._queue.put_nowait((seq, time.time(), events))
        except queue.Full:
            self.batches_dropped += 1
            self.events_dropped += len(events)
            if self.batches_dropped == 1 or self.batches_dropped % 1000 == 0:
                logger.warning(
                    "KV cache events: publisher queue full, %d batches dropped", self.batches_dropped
                )

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, ts, events = item
            # vLLM's EventBatch is an array of all its fields: (ts, events, data_parallel_rank);
            # decoders that read it as a 3-tuple (Dynamo's) refuse a shorter one
            batch = [ts, [encode_event(e, self.block_size) for e in events], DATA_PARALLEL_RANK]
            payload = self._encoder.encode(batch)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError:
                logger.exception("KV cache events: sending batch %d failed", seq)
            self._buffer.append((seq, payload))
            self.batches_sent += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV cache events: malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        # (the first sequence number wanted, big-endian in however many bytes: vLLM reads it so)
        first = int.from_bytes(start, "big")
        try:
            for seq, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", END_SEQ, b""))
        except zmq.ZMQError as e:
            # (the client went away, or cannot take the whole replay: it gets no end marker, so
            # it cannot take a partial replay for a whole one)
            logger.warning("KV cache events: replay from %d cut short: %s", first, e)

    def shutdown(self, timeout: float = 2.0) -> None:
        """Sends what is queued (for up to `timeout` seconds), then closes the sockets. Sockets are
        not thread-safe: when the thread has not ended by then (a subscriber that cannot keep up
        with a full queue), they are left to the process's exit rather than closed under it."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("KV cache events: the publisher did not finish sending within %.0f s", timeout)
            return
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=200)  # ms for the last messages to leave
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
