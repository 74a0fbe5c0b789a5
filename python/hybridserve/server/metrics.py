"""Prometheus metrics of one server (its own registry, never the process-global one).

Engine gauges and counters are read from `engine.stats()` at scrape time, so /metrics always shows
the engine's own numbers; latency histograms are observed by the server as tokens stream out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# engine.stats() key -> (metric name, help). Gauges are levels, counters are running totals.
# Keys and names are listed in docs/serving.md, "Metrics"; ENGINE_KEY_ALIASES lists the scheduler's
# own names, read when the engine's key is absent.
ENGINE_GAUGES = {
    "num_requests_running": ("hybridserve_num_requests_running", "Requests in the running batch."),
    "num_requests_waiting": ("hybridserve_num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_blocks_used": ("hybridserve_kv_blocks_used", "KV cache blocks referenced by requests."),
    "mamba_slots_used": (
        "hybridserve_mamba_slots_used",
        "Mamba state slots in use: running windows plus prefix-cache checkpoints.",
    ),
    "checkpoints_committed": (
        "hybridserve_mamba_checkpoints_committed",
        "Mamba slots holding committed prefix-cache checkpoints (part of mamba_slots_used).",
    ),
    "checkpoints_pending": (
        "hybridserve_mamba_checkpoints_pending",
        "Mamba slots reserved for checkpoints being written (part of mamba_slots_used).",
    ),
    "kv_blocks_cached_free": (
        "hybridserve_kv_blocks_cached_free",
        "KV blocks held by no request but kept for prefix hits.",
    ),
    "kv_blocks_total": ("hybridserve_kv_blocks_total", "KV cache blocks in the pool."),
    "mamba_slots_total": ("hybridserve_mamba_slots_total", "Mamba state slots in the pool."),
    "max_num_seqs": (
        "hybridserve_max_num_seqs",
        "Sequences the engine runs at once (the default lowered to the state pool's capacity).",
    ),
    "mamba_state_capacity_seqs": (
        "hybridserve_mamba_state_capacity_seqs",
        "Sequences the Mamba state pool can run: a window of 1 + K slots and a checkpoint slot each.",
    ),
    "spec_decode_mean_accepted_length": (
        "hybridserve_spec_decode_mean_accepted_length",
        "Tokens a verify step yields per request on average (accepted drafts + 1).",
    ),
    "checkpoint_bytes": (
        "hybridserve_mamba_checkpoint_bytes",
        "Bytes of Mamba state held by prefix-cache checkpoints (committed and pending).",
    ),
}
ENGINE_COUNTERS = {
    "prompt_tokens": ("hybridserve_prompt_tokens", "Prompt tokens processed."),
    "generation_tokens": ("hybridserve_generation_tokens", "Tokens generated."),
    "prefix_cache_queried_tokens": (
        "hybridserve_prefix_cache_queried_tokens",
        "Prompt tokens looked up in the prefix cache.",
    ),
    "prefix_cache_hit_tokens": (
        "hybridserve_prefix_cache_hit_tokens",
        "Prompt tokens served from the prefix cache.",
    ),
    "prefix_cache_lost_tokens": (
        "hybridserve_prefix_cache_lost_tokens",
        "Tokens recomputed because no Mamba checkpoint existed although the KV prefix was cached.",
    ),
    "spec_decode_draft_tokens": (
        "hybridserve_spec_decode_draft_tokens",
        "Draft tokens proposed for verification.",
    ),
    "spec_decode_accepted_tokens": ("hybridserve_spec_decode_accepted_tokens", "Draft tokens accepted."),
    "spec_decode_verify_rows": (
        "hybridserve_spec_decode_verify_steps",
        "Request-steps that verified at least one draft token.",
    ),
    "kv_evictions": ("hybridserve_kv_cache_evictions", "Cached KV blocks evicted."),
    "kv_evictions_useless": (
        "hybridserve_kv_cache_evictions_useless",
        "Cached KV blocks evicted that no prefix hit could use any more (no checkpoint at or below).",
    ),
    "checkpoints_kept": (
        "hybridserve_mamba_checkpoints_kept_last_token",
        "States kept after the last computed token of a finished or preempted request.",
    ),
}

# Labelled families: (metric name, help, label, {label value: engine.stats() key}).
ENGINE_LABELLED_COUNTERS = (
    (
        "hybridserve_prefix_cache_hits_by_source",
        "Admissions that resumed from a Mamba checkpoint, by where the checkpoint was placed.",
        "source",
        {"grid": "prefix_hits_grid", "branch": "prefix_hits_branch", "last_token": "prefix_hits_last_token"},
    ),
    (
        "hybridserve_prefix_cache_hit_tokens_by_source",
        "Prompt tokens served from the prefix cache, by where the checkpoint was placed.",
        "source",
        {
            "grid": "prefix_hit_tokens_grid",
            "branch": "prefix_hit_tokens_branch",
            "last_token": "prefix_hit_tokens_last_token",
        },
    ),
    (
        "hybridserve_mamba_checkpoint_evictions",
        "Mamba checkpoints evicted, by cause: stale (their KV prefix was gone), for a new checkpoint, "
        "for a running window, for KV blocks.",
        "cause",
        {
            "stale": "checkpoint_evictions_stale",
            "for_checkpoint": "checkpoint_evictions_for_checkpoint",
            "for_window": "checkpoint_evictions_for_window",
            "for_kv": "checkpoint_evictions_for_kv",
        },
    ),
)
ENGINE_LABELLED_GAUGES = (
    (
        "hybridserve_mamba_checkpoints",
        "Committed Mamba checkpoints, by where they were placed.",
        "source",
        {"grid": "checkpoints_grid", "branch": "checkpoints_branch", "last_token": "checkpoints_last_token"},
    ),
    (
        "hybridserve_mamba_checkpoint_reuse_rate",
        "Running rate at which checkpoints of each kind get used by a hit before they are evicted.",
        "source",
        {
            "grid": "checkpoint_reuse_rate_grid",
            "branch": "checkpoint_reuse_rate_branch",
            "last_token": "checkpoint_reuse_rate_last_token",
        },
    ),
)
ENGINE_KEY_ALIASES = {
    "num_requests_running": ("num_running",),
    "num_requests_waiting": ("num_waiting",),
    "prefix_cache_queried_tokens": ("prefix_queried_tokens",),
    "prefix_cache_hit_tokens": ("prefix_hit_tokens",),
    "prefix_cache_lost_tokens": ("prefix_lost_tokens",),
    "spec_decode_draft_tokens": ("spec_drafted_tokens",),
    "spec_decode_accepted_tokens": ("spec_accepted_tokens",),
}


def engine_value(stats: dict[str, Any], key: str) -> float:
    """stats[key], or the first alias present, else 0."""
    for k in (key, *ENGINE_KEY_ALIASES.get(key, ())):
        v = stats.get(k)
        if isinstance(v, int | float) and not isinstance(v, bool):
            return float(v)
    return 0.0


_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any] | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        try:
            s = self._stats() or {}
        except Exception:  # a scrape must not fail because the engine is mid-shutdown
            s = {}
        for key, (name, doc) in ENGINE_GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=engine_value(s, key))
        for key, (name, doc) in ENGINE_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=engine_value(s, key))
        for family, table in (
            (CounterMetricFamily, ENGINE_LABELLED_COUNTERS),
            (GaugeMetricFamily, ENGINE_LABELLED_GAUGES),
        ):
            for name, doc, label, keys in table:
                m = family(name, doc, labels=[label])
                for value, key in keys.items():
                    m.add_metric([value], engine_value(s, key))
                yield m
        per_position = CounterMetricFamily(
            "hybridserve_spec_decode_accepted_tokens_per_position",
            "Verify steps whose draft at this position (0-based) was accepted.",
            labels=["position"],
        )
        for pos, n in enumerate(s.get("spec_decode_acceptance_per_position") or []):
            per_position.add_metric([str(pos)], float(n))
        yield per_position


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict[str, Any] | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(stats))
        self.time_to_first_token = Histogram(
            "hybridserve_time_to_first_token_seconds",
            "Time from request arrival to its first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "hybridserve_inter_token_latency_seconds",
            "Time between consecutive generated tokens of one request.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "hybridserve_e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.requests_finished = Counter(
            "hybridserve_requests_finished",
            "Engine requests finished, by finish reason.",
            ["finish_reason"],
            registry=self.registry,
        )
        self.http_errors = Counter(
            "hybridserve_http_errors",
            "Requests answered with an error status.",
            ["status"],
            registry=self.registry,
        )
        self.inflight = Gauge(
            "hybridserve_server_inflight_requests",
            "Engine requests admitted by the server and not finished yet.",
            registry=self.registry,
        )
        self.ready = Gauge("hybridserve_model_ready", "1 once the model is loaded.", registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
