"""KV cache events: a subscriber built only from vLLM's published event schema (msgspec structs as
vLLM documents them, a ZMQ SUB socket and the replay ROUTER protocol) mirrors the real server's
cache and predicts, before each request of a shared-prefix and a multi-turn workload, exactly the
cached tokens the server then reports, while a small Mamba pool evicts checkpoints all along.

The prediction rule is the contract of docs/kv-events.md: walk the request's full blocks through
the announced attention blocks (group 0), then take the deepest announced Mamba checkpoint
(group 1) on that path or in a partial block right below it, at most n - 1 tokens.
"""

from __future__ import annotations

import json
import random
import re
import time
import urllib.request
from typing import Any

import msgspec
import pytest
import zmq

from server_fixtures import ServerProcess, free_port, get_metrics, running_server


# ---- vLLM's event schema (vllm/distributed/kv_events.py), nothing of hybridserve's
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Subscriber:
    """Mirrors the announced blocks per group: id -> (parent id, token ids)."""

    def __init__(self, endpoint: str, replay_endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.groups: dict[int, dict[int | bytes, tuple[int | bytes | None, tuple[int, ...]]]] = {0: {}, 1: {}}
        self.kinds: dict[int, str] = {}
        self.block_size = 0
        self.next_seq = 0
        self.events = 0
        self.replayed = 0

    def apply(self, batch: KVEventBatch) -> None:
        for e in batch.events:
            self.events += 1
            if isinstance(e, AllBlocksCleared):
                for g in self.groups.values():
                    g.clear()
            elif isinstance(e, BlockStored):
                assert e.group_idx is not None and e.kv_cache_spec_kind is not None
                self.kinds[e.group_idx] = e.kv_cache_spec_kind
                self.block_size = e.block_size
                parent = e.parent_block_hash
                # A batch of several hashes is a chain, each the parent of the next.
                for i, h in enumerate(e.block_hashes):
                    toks = tuple(e.token_ids[i * e.block_size : (i + 1) * e.block_size])
                    if len(e.block_hashes) == 1:
                        toks = tuple(e.token_ids)
                    self.groups[e.group_idx][h] = (parent, toks)
                    parent = h
            else:
                assert e.group_idx is not None
                for h in e.block_hashes:
                    self.groups[e.group_idx].pop(h, None)

    def catch_up_by_replay(self) -> None:
        """Asks the replay socket for every batch from `next_seq` on. A DEALER socket, framed as a
        REQ socket frames its request (empty delimiter, then the start): a REQ socket would keep
        only the first of the several answers."""
        req = self.ctx.socket(zmq.DEALER)
        try:
            req.connect(self.replay_endpoint)
            req.send_multipart((b"", self.next_seq.to_bytes(8, "big")))
            while True:
                assert req.poll(10_000), "no replay answer"
                _, seq, payload = req.recv_multipart()
                if seq == END_SEQ:
                    break
                n = int.from_bytes(seq, "big")
                if n >= self.next_seq:
                    self.apply(self.decoder.decode(payload))
                    self.next_seq = n + 1
                    self.replayed += 1
        finally:
            req.close(0)

    def poll(self, timeout_ms: int) -> None:
        while self.sub.poll(timeout_ms):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic.startswith(b"kv")
            n = int.from_bytes(seq, "big")
            if n < self.next_seq:
                continue  # already had it from the replay
            if n > self.next_seq:
                self.catch_up_by_replay()
            if n == self.next_seq:
                self.apply(self.decoder.decode(payload))
                self.next_seq = n + 1
            timeout_ms = 0

    def sync(self, server: ServerProcess) -> None:
        """Until every event the server counts has arrived (and the count is settled)."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            self.poll(20)
            emitted = get_metrics(server)["hybridserve_kv_events_total"]
            if self.events >= emitted:
                time.sleep(0.05)
                self.poll(20)
                if get_metrics(server)["hybridserve_kv_events_total"] == self.events:
                    return
        raise AssertionError(f"events: received {self.events}, server emitted {emitted}")

    def child(self, group: int, parent: int | bytes | None, tokens: list[int]) -> int | bytes | None:
        want = tuple(tokens)
        for h, (p, toks) in self.groups[group].items():
            if p == parent and toks == want:
                return h
        return None

    def predict(self, tokens: list[int]) -> int:
        b = self.block_size
        top = len(tokens) - 1
        path: list[int | bytes] = []
        while (len(path) + 1) * b <= top:
            d = len(path)
            h = self.child(0, path[-1] if path else None, tokens[d * b : (d + 1) * b])
            if h is None:
                break
            path.append(h)
        for d in range(len(path), -1, -1):
            parent = path[d - 1] if d else None
            for t in range(b - 1, 0, -1):
                if d * b + t <= top and self.child(1, parent, tokens[d * b : d * b + t]) is not None:
                    return d * b + t
            if parent is not None and parent in self.groups[1]:
                return d * b
        return 0

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def complete(server: ServerProcess, tokens: list[int], max_tokens: int) -> dict[str, Any]:
    body = {
        "model": "demo",
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,  # every answer runs to max_tokens (the demo model ends paragraphs)
        "return_token_ids": True,
    }
    req = urllib.request.Request(
        server.base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        out: dict[str, Any] = json.loads(r.read())
    return out


def workload(rng: random.Random) -> list[tuple[str, list[int] | None, int]]:
    """(kind, prompt or None for "next turn of conversation i", conversation) in send order:
    shared system prompts of odd lengths with user suffixes, interleaved with 3-turn chats."""
    systems = [[rng.randrange(100, 700) for _ in range(n)] for n in (53, 90, 131)]
    out: list[tuple[str, list[int] | None, int]] = []
    for turn in range(3):
        for u in range(4):
            sysp = systems[(u + turn) % 3]
            out.append(("shared", sysp + [rng.randrange(100, 700) for _ in range(5 + 7 * u)], -1))
        for conv in range(3):
            first = [rng.randrange(100, 700) for _ in range(20 + 13 * conv)]
            out.append(("chat", first if turn == 0 else None, conv))
    return out


@pytest.mark.parametrize("speculative", [False, True], ids=["mode-all", "align-ngram"])
def test_subscriber_predicts_every_hit(speculative: bool) -> None:
    pub, replay = free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": "kv@replica-0@demo",
    }
    # Windows of 2 sequences (1 + K slots each) leave a handful of slots for checkpoints.
    flags = ["--kv-events-config", json.dumps(config), "--max-num-seqs", "2"]
    if speculative:
        flags += ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    flags += ["--num-mamba-slots", "20" if speculative else "12"]
    rng = random.Random(7 + speculative)
    with running_server(*flags) as server:
        # Joins after the first requests: what it missed comes from the replay socket.
        complete(server, [rng.randrange(100, 700) for _ in range(40)], 4)
        sub = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
        try:
            time.sleep(0.3)  # the SUB connection is up before anything it must not miss
            sub.catch_up_by_replay()
            convs: dict[int, list[int]] = {}
            hits = {"shared": 0, "chat": 0}
            for kind, prompt, conv in workload(rng):
                if prompt is None:  # the next turn: prompt + answer + a new message
                    prompt = convs[conv] + [rng.randrange(100, 700) for _ in range(9)]
                sub.sync(server)
                predicted = sub.predict(prompt)
                out = complete(server, prompt, 6)
                got = out["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert predicted == got, (kind, len(prompt), predicted, got)
                hits[kind] += got
                if kind == "chat":
                    convs[conv] = prompt + out["choices"][0]["token_ids"]
            m = get_metrics(server)
        finally:
            sub.close()
    # Not vacuous: both workloads hit, checkpoints were evicted, and the events told of it.
    assert hits["shared"] > 0 and hits["chat"] > 0, hits
    evicted = sum(v for k, v in m.items() if k.startswith("hybridserve_mamba_checkpoint_evictions_total"))
    assert evicted > 0, "the Mamba pool was never short: eviction untested"
    assert sub.kinds == {0: "full_attention", 1: "mamba"}
    assert sub.replayed > 0


def test_bad_kv_events_config_is_a_clear_start_error() -> None:
    srv = ServerProcess("--kv-events-config", '{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}')
    try:
        rc = srv.wait_exit(120)
        assert rc == 2, srv.output()[-2000:]
        assert "--kv-events-config: unknown field(s) 'endpont'" in srv.output()
    finally:
        srv.stop()
        srv.remove_log()


def test_kv_events_addresses_that_cannot_be_opened_are_config_errors_naming_the_field() -> None:
    """Checked with the flag: a tcp:// port out of range (ZMQ bound 99999 modulo 65536), a
    tcp:// address without host or port, ipc:// without a path. When the socket opens: a port
    that is taken, for the PUB endpoint and for the replay endpoint, each named."""
    from hybridserve.config.kv_events import KVEventsConfig
    from hybridserve.engine.kv_events import KVEventPublisher
    from hybridserve.errors import ConfigError

    for field in ("endpoint", "replay_endpoint"):
        for address, says in (
            ("tcp://*:99999", "the port must be an integer in [0, 65535]"),
            ("tcp://", "a tcp:// address is HOST:PORT"),
            ("tcp://*:", "the port must be"),
            ("tcp://localhost", "a tcp:// address is HOST:PORT"),
            ("ipc://", "no path"),
            ("inproc://", "no name"),
        ):
            with pytest.raises(
                ConfigError, match=re.escape(f"--kv-events-config: {field} '{address}': {says}")
            ):
                KVEventsConfig.from_value({"enable_kv_cache_events": True, field: address})
    taken = zmq.Context.instance().socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        for fields, field in (
            ({"endpoint": f"tcp://*:{port}"}, "endpoint"),
            (
                {"endpoint": "inproc://kv-events-test", "replay_endpoint": f"tcp://*:{port}"},
                "replay_endpoint",
            ),
        ):
            cfg = KVEventsConfig.from_value({"enable_kv_cache_events": True, **fields})
            with pytest.raises(
                ConfigError, match=f"cannot open {field} tcp://\\*:{port}: Address already in use"
            ):
                KVEventPublisher(cfg, 16)
    finally:
        taken.close(linger=0)


def test_events_off_by_default_and_vllm_metric_names() -> None:
    """Without the flag nothing is recorded; the metric names routers and endpoint pickers read
    are there with vLLM's types (the gateway-api-inference-extension model server protocol:
    vllm:num_requests_waiting, vllm:num_requests_running, vllm:kv_cache_usage_perc, optionally
    vllm:cache_config_info with block_size and num_gpu_blocks labels)."""
    with running_server() as server:
        complete(server, list(range(100, 160)), 3)
        with urllib.request.urlopen(server.base + "/metrics", timeout=30) as r:
            text = r.read().decode()
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE "))
    assert types["vllm:num_requests_waiting"] == "gauge"
    assert types["vllm:num_requests_running"] == "gauge"
    assert types["vllm:kv_cache_usage_perc"] == "gauge"
    assert types["vllm:cache_config_info"] == "gauge"
    info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert 'block_size="16"' in info and 'num_gpu_blocks="' in info and 'model_name="demo"' in info
    m = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert m['vllm:prompt_tokens_total{model_name="demo"}'] == 60
    assert m['vllm:generation_tokens_total{model_name="demo"}'] == 3
    assert 0 <= m['vllm:kv_cache_usage_perc{model_name="demo"}'] <= 1
    assert m["hybridserve_kv_events_total"] == 0
    assert m['vllm:request_success_total{finished_reason="length",model_name="demo"}'] == 1
    assert types["vllm:time_to_first_token_seconds"] == "histogram"
