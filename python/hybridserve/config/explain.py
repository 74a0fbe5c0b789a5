"""The resolved configuration and how it is explained: `ResolvedEngineConfig` (the core's config,
every decision of the policy and the Python-side settings), the text of `hybridserve config
[--explain]`, and the log lines the engine writes once at start."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybridserve import _core
from hybridserve.config.capabilities import ModelCapabilities
from hybridserve.config.speculative import SpeculativeConfig

if TYPE_CHECKING:
    from hybridserve.config.args import EngineArgs

logger = logging.getLogger("hybridserve.config")


@dataclass(frozen=True)
class Decision:
    """One decision of the policy: `code` (stable id), `level` ("info" | "warning"), `message`."""

    code: str
    level: str
    message: str

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "level": self.level, "message": self.message}


@dataclass(frozen=True)
class ResolvedEngineConfig:
    """The resolved configuration: the Rust `core` config, the decisions, and the Python-side
    settings (dtype, speculative details, cache budgets). Attributes of `core` (mamba_cache_mode,
    block_size, ...) are also readable directly on this object."""

    core: _core.ResolvedConfig
    args: EngineArgs
    capabilities: ModelCapabilities
    #: The model folder the capabilities came from (None when the caller passed them).
    model_dir: str | None
    #: The resolved dtype name (never "auto").
    dtype: str
    speculative: SpeculativeConfig | None
    #: The policy's decisions followed by the Python-side ones.
    decisions: list[Decision]

    @property
    def config(self) -> _core.ResolvedConfig:
        return self.core

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found normally: forward to the Rust config.
        if name.startswith("_") or name in ("core",):
            raise AttributeError(name)
        return getattr(self.core, name)

    def to_dict(self) -> dict[str, Any]:
        """One JSON object (what `hybridserve config --json` prints)."""
        from hybridserve.config.args import parse_shared_prefix_markers  # (args imports this module)

        out = dict(self.core.to_dict())
        a = self.args
        out.update(
            {
                "model": a.model,
                "model_dir": self.model_dir,
                "tokenizer": a.tokenizer,
                "load_format": a.load_format,
                "dtype": self.dtype,
                "mamba_ssm_cache_dtype": a.mamba_ssm_cache_dtype,
                "kv_cache_dtype": a.kv_cache_dtype,
                "max_logprobs": a.max_logprobs,
                "gpu_memory_utilization": a.gpu_memory_utilization,
                "device": a.device,
                "seed": a.seed,
                "speculative": None if self.speculative is None else self.speculative.to_dict(),
                "kv_cache_memory": a.kv_cache_memory,
                "mamba_cache_memory": a.mamba_cache_memory,
                "cache_memory": a.cache_memory,
                "num_kv_blocks": a.num_kv_blocks,
                "num_mamba_slots": a.num_mamba_slots,
                "max_queue_len": a.max_queue_len,
                "cpu_threads": a.cpu_threads,
                "async_scheduling": a.async_scheduling,
                "tensor_parallel_size": a.tensor_parallel_size,
                "grammar_compile_timeout": a.grammar_compile_timeout,
                "shared_prefix_markers": _markers_json(parse_shared_prefix_markers(a.shared_prefix_markers)),
                # the seed itself is a secret (docs/prefix-caching.md, "Block hashes"): only whether one was given
                "prefix_cache_hash_seed_given": a.prefix_cache_hash_seed is not None,
                "kv_events": None if (kv := a.kv_events()) is None else dataclasses.asdict(kv),
                "capabilities": self.capabilities.to_dict(),
                "decisions": [d.to_dict() for d in self.decisions],
            }
        )
        return out


def _markers_json(markers: str | tuple[int, ...]) -> str | list[int]:
    return markers if isinstance(markers, str) else list(markers)


_SUMMARY_KEYS = (
    "enable_prefix_caching",
    "mamba_cache_mode",
    "checkpoint_placement",
    "eviction",
    "enable_chunked_prefill",
    "block_size",
    "mamba_block_size",
    "scan_chunk_size",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "speculative",
    "dtype",
)


def _fmt_value(v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    if v is None:
        return "off"
    if isinstance(v, dict):
        return ", ".join(f"{k}={val}" for k, val in v.items())
    return str(v)


def format_resolved(resolved: ResolvedEngineConfig, explain: bool = False) -> str:
    """The text of `hybridserve config` (and, with explain, of `--explain`)."""
    d = resolved.to_dict()
    caps = resolved.capabilities
    shown_dir = resolved.model_dir if resolved.model_dir not in (None, resolved.args.model) else None
    lines = [f"model: {resolved.args.model}" + (f" ({shown_dir})" if shown_dir else "")]
    if explain:
        lines.append(
            f"  capabilities: type {caps.model_type}, Mamba layers {caps.num_mamba_layers}, attention "
            f"layers {caps.num_attention_layers}, boundary states {_fmt_value(caps.supports_boundary_states)}, "
            f"scan chunk size {caps.scan_chunk_size}, max_position_embeddings {caps.max_position_embeddings}"
        )
    width = max(len(k) for k in _SUMMARY_KEYS)
    for key in _SUMMARY_KEYS:
        lines.append(f"  {key:<{width}}  {_fmt_value(d.get(key))}")
    if explain:
        lines.append("decisions:")
        if not resolved.decisions:
            lines.append("  (none: every value was given explicitly)")
        for dec in resolved.decisions:
            lines.append(f"  [{dec.level}] {dec.code}: {dec.message}")
    return "\n".join(lines)


def log_decisions(resolved: Any, log: logging.Logger | None = None) -> None:
    """Logs the resolved configuration (one info line) and every decision at its level. Called once
    by the engine at start. Accepts a ResolvedEngineConfig or a bare `_core.ResolvedConfig`."""
    log = log or logger
    core = getattr(resolved, "core", resolved)
    spec = core.speculative_method
    log.info(
        "config: prefix caching %s, mamba_cache_mode %s (checkpoints: %s, eviction: %s), chunked prefill %s, "
        "block_size %d, mamba_block_size %d, max_num_batched_tokens %d, max_num_seqs %d, max_model_len %d, "
        "speculative %s",
        _fmt_value(core.enable_prefix_caching),
        core.mamba_cache_mode,
        core.checkpoint_placement,
        core.eviction,
        _fmt_value(core.enable_chunked_prefill),
        core.block_size,
        core.mamba_block_size,
        core.max_num_batched_tokens,
        core.max_num_seqs,
        core.max_model_len,
        "off" if spec is None else f"{spec} k={core.num_speculative_tokens}",
    )
    for d in resolved.decisions:
        level = logging.WARNING if d.level == "warning" else logging.INFO
        log.log(level, "config decision %s: %s", d.code, d.message)
