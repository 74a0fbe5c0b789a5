"""Prometheus metrics of one server (its own registry, never the process-global one).

Engine gauges and counters are read from `engine.stats()` at scrape time, so /metrics always shows
the engine's own numbers; latency histograms are observed by the server as tokens stream out,
and a finished request's phases (queue, prefill, decode) from the times the engine kept of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hybridserve import _core
from hybridserve.engine.outputs import RequestMetrics

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
    "kv_events_emitted": (
        "hybridserve_kv_events",
        "KV cache events published for subscribers (0 unless --kv-events-config enables them); "
        "a dropped batch's events are not counted.",
    ),
    "kv_event_batches_dropped": (
        "hybridserve_kv_event_batches_dropped",
        "Batches of KV cache events dropped because the publisher's queue was full (their "
        "sequence numbers are skipped).",
    ),
    "checkpoints_kept": (
        "hybridserve_mamba_checkpoints_kept_last_token",
        "States kept after the last computed token of a finished or preempted request.",
    ),
}

# Where a Mamba checkpoint was placed: a grid point, a branch point a second request found, the
# last token of a finished sequence, the end of a declared shared prefix (a system message).
CHECKPOINT_KINDS = _core.CHECKPOINT_KINDS

# Labelled families: (metric name, help, label, {label value: engine.stats() key}).
ENGINE_LABELLED_COUNTERS = (
    (
        "hybridserve_prefix_cache_hits_by_source",
        "Admissions that resumed from a Mamba checkpoint, by where the checkpoint was placed.",
        "source",
        {kind: f"prefix_hits_{kind}" for kind in CHECKPOINT_KINDS},
    ),
    (
        "hybridserve_prefix_cache_hit_tokens_by_source",
        "Prompt tokens served from the prefix cache, by where the checkpoint was placed.",
        "source",
        {kind: f"prefix_hit_tokens_{kind}" for kind in CHECKPOINT_KINDS},
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
        {kind: f"checkpoints_{kind}" for kind in CHECKPOINT_KINDS},
    ),
    (
        "hybridserve_mamba_checkpoint_reuse_rate",
        "Running rate at which checkpoints of each kind get used by a hit before they are evicted.",
        "source",
        {kind: f"checkpoint_reuse_rate_{kind}" for kind in CHECKPOINT_KINDS},
    ),
)
# vLLM's names for the same figures (docs/serving.md, "Metrics"), read by routers, endpoint pickers
# and autoscalers written for vLLM; each carries a `model_name` label as vLLM's do.
# name -> (engine.stats() key, help)
VLLM_GAUGES = {
    "vllm:num_requests_running": ("num_requests_running", "Number of requests in model execution batches."),
    "vllm:num_requests_waiting": ("num_requests_waiting", "Number of requests waiting to be processed."),
}
VLLM_COUNTERS = {
    "vllm:prompt_tokens": ("prompt_tokens", "Number of prefill tokens processed."),
    "vllm:generation_tokens": ("generation_tokens", "Number of generation tokens processed."),
    # (as vLLM's: the lookups of requests not preempted before; the hybridserve_ names count all)
    "vllm:prefix_cache_queries": (
        "vllm_prefix_cache_queried_tokens",
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    "vllm:prefix_cache_hits": (
        "vllm_prefix_cache_hit_tokens",
        "Prefix cache hits, in terms of number of cached tokens (a hybrid hit needs KV and a Mamba state).",
    ),
    "vllm:num_preemptions": ("num_preemptions_total", "Cumulative number of preemptions."),
    "vllm:spec_decode_num_drafts": ("spec_decode_verify_rows", "Number of spec decoding drafts."),
    "vllm:spec_decode_num_draft_tokens": ("spec_decode_draft_tokens", "Number of draft tokens."),
    "vllm:spec_decode_num_accepted_tokens": ("spec_decode_accepted_tokens", "Number of accepted tokens."),
}
#: vllm:kv_cache_usage_perc (and its older name): a fraction in [0, 1], as vLLM's is.
VLLM_CACHE_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def cache_usage(stats: dict[str, Any]) -> float:
    """The share of the cache that running requests hold, in [0, 1]: the larger of the KV pool's
    (blocks referenced by requests; cached free blocks count as free, they are evictable) and the
    Mamba state pool's (running sequences' windows out of the max_num_seqs windows it reserves).
    Either pool being full is what stops admission, so the larger share is the load signal."""
    kv_total = engine_value(stats, "kv_blocks_total")
    kv = engine_value(stats, "kv_blocks_used") / kv_total if kv_total else 0.0
    seqs = engine_value(stats, "max_num_seqs")
    mamba = (
        engine_value(stats, "num_requests_running") / seqs
        if seqs and engine_value(stats, "mamba_slots_total")
        else 0.0
    )
    return min(1.0, max(kv, mamba))


ENGINE_KEY_ALIASES = {
    "num_requests_running": ("num_running",),
    "num_requests_waiting": ("num_waiting",),
    "prefix_cache_queried_tokens": ("prefix_queried_tokens",),
    "prefix_cache_hit_tokens": ("prefix_hit_tokens",),
    "prefix_cache_lost_tokens": ("prefix_lost_tokens",),
    "vllm_prefix_cache_queried_tokens": ("prefix_cache_queried_tokens", "prefix_queried_tokens"),
    "vllm_prefix_cache_hit_tokens": ("prefix_cache_hit_tokens", "prefix_hit_tokens"),
    "spec_decode_draft_tokens": ("spec_drafted_tokens",),
    "spec_decode_accepted_tokens": ("spec_accepted_tokens",),
    "num_preemptions_total": ("num_preemptions",),
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


# Above 80 s, vLLM's own tops: a first token up to 2560 s, a request (or its phase) up to 7680 s
# (a long prompt on a CPU engine takes minutes; quantiles beyond the last bucket read as it)
_TTFT_BUCKETS = (*_LATENCY_BUCKETS, 160.0, 640.0, 2560.0)
_REQUEST_BUCKETS = (*_LATENCY_BUCKETS, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# request sizes in tokens: 1, 2, 5, 10, 20, 50, ... up to a million (vLLM's 1-2-5 series)
_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5) if m * 10**e <= 1_000_000)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any] | None], model_name: str) -> None:
        self._stats = stats
        self._model_name = model_name

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
        yield from self._vllm(s)

    def _vllm(self, s: dict[str, Any]) -> Iterator[Metric]:
        """The same figures under vLLM's names."""
        label = ["model_name"]
        value = [self._model_name]
        for name, (key, doc) in VLLM_GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=label)
            g.add_metric(value, engine_value(s, key))
            yield g
        for name in VLLM_CACHE_USAGE:
            g = GaugeMetricFamily(name, "KV-cache usage. 1 means 100 percent usage.", labels=label)
            g.add_metric(value, cache_usage(s))
            yield g
        for name, (key, doc) in VLLM_COUNTERS.items():
            c = CounterMetricFamily(name, doc, labels=label)
            c.add_metric(value, engine_value(s, key))
            yield c
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the cache config (labels); value 1.",
            labels=["model_name", "block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )
        if "block_size" in s:
            info.add_metric(
                [
                    self._model_name,
                    str(int(engine_value(s, "block_size"))),
                    str(int(engine_value(s, "kv_blocks_total"))),
                    str(bool(s.get("enable_prefix_caching"))),
                ],
                1.0,
            )
        yield info


class _Histogram:
    """A histogram under hybridserve's name and, labelled with the model, vLLM's (of seconds
    unless other buckets are given)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        name: str,
        doc: str,
        model_name: str,
        buckets: tuple[float, ...] = _LATENCY_BUCKETS,
    ) -> None:
        self.own = Histogram(f"hybridserve_{name}", doc, buckets=buckets, registry=registry)
        self.vllm = Histogram(f"vllm:{name}", doc, ["model_name"], buckets=buckets, registry=registry).labels(
            model_name=model_name
        )

    def observe(self, value: float) -> None:
        self.own.observe(value)
        self.vllm.observe(value)


class _Finished:
    """Requests finished by reason: hybridserve_requests_finished, and vLLM's
    vllm:request_success for the reasons vLLM counts there (stop, length, abort)."""

    VLLM_REASONS = ("stop", "length", "abort")

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.own = Counter(
            "hybridserve_requests_finished",
            "Engine requests finished, by finish reason.",
            ["finish_reason"],
            registry=registry,
        )
        self.vllm = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self._model_name = model_name
        # Every reason's series exists from the start, at 0, as vLLM's do: a series that first
        # appears at 1 loses that request to rate() and increase(), which count from a first sample
        for reason in (*self.VLLM_REASONS, "error"):
            self.own.labels(finish_reason=reason)
        for reason in self.VLLM_REASONS:
            self.vllm.labels(model_name=model_name, finished_reason=reason)

    def inc(self, finish_reason: str) -> None:
        self.own.labels(finish_reason=finish_reason).inc()
        if finish_reason in self.VLLM_REASONS:
            self.vllm.labels(model_name=self._model_name, finished_reason=finish_reason).inc()


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict[str, Any] | None], model_name: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(stats, model_name))
        self.time_to_first_token = _Histogram(
            self.registry,
            "time_to_first_token_seconds",
            "Time from request arrival to its first generated token.",
            model_name,
            buckets=_TTFT_BUCKETS,
        )
        self.inter_token_latency = _Histogram(
            self.registry,
            "inter_token_latency_seconds",
            "Time between consecutive generated tokens of one request.",
            model_name,
        )
        self.e2e_latency = _Histogram(
            self.registry,
            "e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            model_name,
            buckets=_REQUEST_BUCKETS,
        )
        # the phases of a finished request, from the engine's clock (RequestMetrics)
        self.request_queue_time = _Histogram(
            self.registry,
            "request_queue_time_seconds",
            "Time a request waited in the engine before its first step.",
            model_name,
            buckets=_REQUEST_BUCKETS,
        )
        self.request_prefill_time = _Histogram(
            self.registry,
            "request_prefill_time_seconds",
            "Time from a request's first step to its first token.",
            model_name,
            buckets=_REQUEST_BUCKETS,
        )
        self.request_decode_time = _Histogram(
            self.registry,
            "request_decode_time_seconds",
            "Time from a request's first token to its last.",
            model_name,
            buckets=_REQUEST_BUCKETS,
        )
        self.request_inference_time = _Histogram(
            self.registry,
            "request_inference_time_seconds",
            "Time from a request's first step to its end.",
            model_name,
            buckets=_REQUEST_BUCKETS,
        )
        self.request_prompt_tokens = _Histogram(
            self.registry,
            "request_prompt_tokens",
            "Prompt tokens of a finished request.",
            model_name,
            buckets=_TOKEN_BUCKETS,
        )
        self.request_generation_tokens = _Histogram(
            self.registry,
            "request_generation_tokens",
            "Generated tokens of a finished request.",
            model_name,
            buckets=_TOKEN_BUCKETS,
        )
        self.requests_finished = _Finished(self.registry, model_name)
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

    def observe_finished(
        self, phases: RequestMetrics | None, prompt_tokens: int, generation_tokens: int
    ) -> None:
        """A request the engine finished: its sizes, and the phases it reached."""
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        if phases is None:
            return
        for histogram, seconds in (
            (self.request_queue_time, phases.queue_time),
            (self.request_prefill_time, phases.prefill_time),
            (self.request_decode_time, phases.decode_time),
            (self.request_inference_time, phases.inference_time),
        ):
            if seconds is not None:
                histogram.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
