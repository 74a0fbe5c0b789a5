"""`--kv-events-config`: where the engine publishes its KV cache events (docs/kv-events.md).

The fields, their names, defaults and meanings are vLLM's `KVEventsConfig`, so that a deployment
written for vLLM (and the routers and indexers that read vLLM's events) works unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hybridserve.config.json_flag import parse_json_object
from hybridserve.errors import ConfigError

FLAG = "--kv-events-config"
PUBLISHERS = ("null", "zmq")
_ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    #: Record and publish KV cache events.
    enable_kv_cache_events: bool = False
    #: "zmq" or "null"; None = "zmq" when enabled, else "null".
    publisher: str | None = None
    #: ZMQ PUB endpoint. Bound when it contains "*" or "::" or is ipc:// / inproc://, connected to
    #: otherwise (a subscriber that binds, "centralised" mode).
    endpoint: str = "tcp://*:5557"
    #: Optional ZMQ ROUTER endpoint (always bound) where a subscriber that missed batches asks for
    #: them again by sequence number.
    replay_endpoint: str | None = None
    #: Batches kept for replay.
    buffer_steps: int = 10_000
    #: ZMQ high-water mark of the PUB socket (messages queued per subscriber before dropping).
    hwm: int = 100_000
    #: Batches queued between the engine loop and the publisher thread before new ones are dropped.
    max_queue_size: int = 100_000
    #: Topic frame of every message (subscribers filter on its prefix).
    topic: str = ""

    @property
    def enabled(self) -> bool:
        """Whether events are recorded and sent anywhere."""
        return self.enable_kv_cache_events and self.resolved_publisher == "zmq"

    @property
    def resolved_publisher(self) -> str:
        if self.publisher is not None:
            return self.publisher
        return "zmq" if self.enable_kv_cache_events else "null"

    @staticmethod
    def binds(endpoint: str) -> bool:
        """vLLM's rule: bind a stable endpoint (wildcard host, ipc, inproc), connect otherwise."""
        return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))

    @classmethod
    def from_value(cls, value: KVEventsConfig | dict[str, Any] | str) -> KVEventsConfig:
        """From a config, a dict, or the flag's JSON text; ConfigError names the flag and field."""
        if isinstance(value, KVEventsConfig):
            value.validate()
            return value
        if isinstance(value, str):
            value = parse_json_object(value, FLAG)
        if not isinstance(value, dict):
            raise ConfigError(f"{FLAG} must be a JSON object, got {value!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ConfigError(
                f"{FLAG}: unknown field(s) {', '.join(map(repr, unknown))}; known: {', '.join(sorted(names))}"
            )
        cfg = cls(**value)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ConfigError(f"{FLAG}: enable_kv_cache_events must be true or false")
        if self.publisher is not None and self.publisher not in PUBLISHERS:
            raise ConfigError(
                f"{FLAG}: publisher must be one of {', '.join(PUBLISHERS)}, got {self.publisher!r}"
            )
        for name in ("endpoint", "replay_endpoint"):
            v = getattr(self, name)
            if v is None and name == "replay_endpoint":
                continue
            if not isinstance(v, str) or not v.startswith(_ENDPOINT_SCHEMES):
                raise ConfigError(f"{FLAG}: {name} must be a tcp://, ipc:// or inproc:// address, got {v!r}")
            if (why := _endpoint_error(v)) is not None:
                raise ConfigError(f"{FLAG}: {name} {v!r}: {why}")
        # (hwm 0 is ZMQ's "no limit", max_queue_size 0 Python's unbounded queue: vLLM takes both)
        for name, low in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= 10**9:
                raise ConfigError(f"{FLAG}: {name} must be an integer in [{low}, 1e9], got {v!r}")
        if not isinstance(self.topic, str):
            raise ConfigError(f"{FLAG}: topic must be a string, got {self.topic!r}")


def _endpoint_error(endpoint: str) -> str | None:
    """Why a ZMQ address cannot name a socket, or None: tcp:// needs HOST:PORT with a port in
    [0, 65535] or "*" (ZMQ took 99999 modulo 65536), ipc:// a path, inproc:// a name."""
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return None if rest else f"no {'path' if scheme == 'ipc' else 'name'} after {scheme}://"
    host, sep, port = rest.rpartition(":")
    if not sep or not host:
        return "a tcp:// address is HOST:PORT (a host or * for every interface)"
    if port != "*" and not (port.isascii() and port.isdigit() and int(port) <= 65535):
        return f"the port must be an integer in [0, 65535] or *, got {port!r}"
    return None
