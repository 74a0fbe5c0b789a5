"""The KV-event publisher's wire contract, on its own (no server): every batch is vLLM's full
`EventBatch` array, a batch the full queue drops leaves its sequence number unsent (a gap a
subscriber sees), a replay of a large buffer is whole or has no end marker; and a failed engine
step publishes the emptied cache at once, not with the next request's step."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from hybridserve import LLM, SamplingParams
from hybridserve.config.kv_events import KVEventsConfig
from hybridserve.engine.kv_events import END_SEQ, KVEventPublisher
from hybridserve.errors import ConfigError, StepError

STORED = ("stored", 0, 7, None, [1, 2, 3, 4])


def publisher(tmp_path: Path, **fields: Any) -> KVEventPublisher:
    cfg = KVEventsConfig.from_value(
        {
            "enable_kv_cache_events": True,
            "endpoint": f"ipc://{tmp_path}/pub",
            "replay_endpoint": f"ipc://{tmp_path}/replay",
            "topic": "kv",
            **fields,
        }
    )
    return KVEventPublisher(cfg, block_size=4)


def subscribe(ctx: zmq.Context[Any], tmp_path: Path) -> zmq.Socket[bytes]:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"ipc://{tmp_path}/pub")
    time.sleep(0.3)  # (a PUB socket sends nothing to a subscriber before it has joined)
    return sub


def receive(sub: zmq.Socket[bytes], n: int) -> list[tuple[int, Any]]:
    got = []
    while len(got) < n:
        assert sub.poll(10_000), f"received {len(got)} of {n} batches"
        _, seq, payload = sub.recv_multipart()
        got.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
    return got


def wait_sent(pub: KVEventPublisher, n: int) -> None:
    deadline = time.monotonic() + 30
    while pub.batches_sent < n:
        assert time.monotonic() < deadline, f"sent {pub.batches_sent} of {n}"
        time.sleep(0.01)


def test_a_batch_is_vllm_s_whole_event_batch_array(tmp_path: Path) -> None:
    pub = publisher(tmp_path)
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        sub = subscribe(ctx, tmp_path)
        pub.publish([STORED])
        ((seq, batch),) = receive(sub, 1)
        # [ts, events, data_parallel_rank]: a 3-tuple to decoders that read it as one
        assert seq == 0 and len(batch) == 3 and batch[2] == 0
        assert isinstance(batch[0], float) and batch[1][0]["type"] == "BlockStored"
        sub.close(0)
    finally:
        pub.shutdown()
        ctx.term()


def test_a_dropped_batch_leaves_a_gap_in_the_sequence_numbers(tmp_path: Path) -> None:
    pub = publisher(tmp_path, max_queue_size=1)
    ctx: zmq.Context[Any] = zmq.Context()
    held, release = threading.Event(), threading.Event()
    encode = pub._encoder.encode

    def slow_encode(obj: Any) -> bytes:
        held.set()
        release.wait(10)  # (the thread holds the first batch: the queue fills behind it)
        return encode(obj)

    try:
        sub = subscribe(ctx, tmp_path)
        pub._encoder = type("E", (), {"encode": staticmethod(slow_encode)})()  # type: ignore[assignment]
        pub.publish([STORED])  # 0: taken by the thread, held
        assert held.wait(10)
        for _ in range(5):
            pub.publish([STORED])  # 1 fills the queue; 2 to 5 are dropped
        release.set()
        wait_sent(pub, 2)
        pub.publish([STORED, STORED])  # 6
        got = receive(sub, 3)
        assert [seq for seq, _ in got] == [0, 1, 6]
        assert (pub.batches_dropped, pub.events_dropped) == (4, 4)
        sub.close(0)
    finally:
        release.set()
        pub.shutdown()
        ctx.term()


def test_a_replay_of_a_large_buffer_is_whole(tmp_path: Path) -> None:
    n = 4000  # (more than a ROUTER socket's default high-water mark of 1000 messages)
    pub = publisher(tmp_path, buffer_steps=n)
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        for i in range(n):
            pub.publish([("stored", 0, i + 1, None, [i])])
        wait_sent(pub, n)
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"ipc://{tmp_path}/replay")
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        seqs = []
        while True:
            assert dealer.poll(10_000), f"replay stopped after {len(seqs)} batches"
            _, seq, _ = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            seqs.append(int.from_bytes(seq, "big"))
        assert seqs == list(range(n))
        # the first sequence number in fewer bytes (vLLM reads any length): the replay from it
        dealer.send_multipart((b"", (n - 2).to_bytes(2, "big")))
        got = []
        while True:
            assert dealer.poll(10_000), "no answer to a 2-byte replay request"
            _, seq, _ = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            got.append(int.from_bytes(seq, "big"))
        assert got == [n - 2, n - 1]
        dealer.close(0)
    finally:
        pub.shutdown()
        ctx.term()


def test_zero_is_no_limit_for_hwm_and_the_queue_as_in_vllm(tmp_path: Path) -> None:
    pub = publisher(tmp_path, hwm=0, max_queue_size=0)
    pub.shutdown()
    with pytest.raises(ConfigError, match="buffer_steps"):
        publisher(tmp_path, buffer_steps=0)


def test_a_failed_step_publishes_the_emptied_cache_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(
        "demo",
        dtype="float32",
        max_model_len=256,
        kv_events_config={"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/engine"},
    )
    engine = llm.engine
    assert engine.kv_events is not None
    published: list[list[Any]] = []
    real = engine.kv_events.publish

    def spy(events: list[Any]) -> None:
        published.append(list(events))
        real(events)

    monkeypatch.setattr(engine.kv_events, "publish", spy)
    params = SamplingParams(max_tokens=2, temperature=0)
    llm.generate("A prompt long enough to fill a few blocks of the cache, and then some more.", params)
    assert any(e[0] == "stored" for batch in published for e in batch)
    engine.add_request("x", "Another prompt, which fails in its step.", params)

    def broken_forward(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(engine.runner, "decode_step", None)  # (the native step would take it)
    monkeypatch.setattr(engine.em.model, "forward", broken_forward)
    published.clear()
    with pytest.raises(StepError):
        engine.step()
    # (no further step ran: the engine is idle)
    assert any(e[0] == "cleared" for batch in published for e in batch), published


def test_a_dropped_llm_frees_its_endpoints_for_the_next(tmp_path: Path) -> None:
    """An engine that is dropped (its LLM let go of) closes its publisher, as vLLM's: a second
    LLM in the process binds the same endpoints (it was refused: "Address already in use"), and
    the first one's thread is gone. An engine kept by its caller (`llm.llm_engine`) keeps
    publishing after its LLM is gone."""
    import gc
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"ipc://{tmp_path}/r",
    }

    def kv_threads() -> int:
        return sum(t.name == "kv-events" and t.is_alive() for t in threading.enumerate())

    before = kv_threads()
    llm = LLM("demo", dtype="float32", max_model_len=256, kv_events_config=cfg)
    assert kv_threads() == before + 1
    del llm
    gc.collect()
    assert kv_threads() == before
    engine = LLM("demo", dtype="float32", max_model_len=256, kv_events_config=cfg).llm_engine
    gc.collect()
    assert engine.kv_events is not None and kv_threads() == before + 1
    del engine
    gc.collect()
    again = LLM("demo", dtype="float32", max_model_len=256, kv_events_config=cfg)
    assert again.generate(["The morning was"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    again.engine.shutdown()  # (shut down by hand: nothing more when it is collected)
    assert kv_threads() == before
