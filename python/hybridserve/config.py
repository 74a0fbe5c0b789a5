"""Engine arguments, model capabilities and the `hybridserve config` subcommand.

`EngineArgs` (a dataclass whose fields are the CLI flags with underscores) turns into the typed
inputs of the Rust cache-mode policy (`rust/policy.rs`, DESIGN.md §5); `EngineArgs.resolve(caps)`
returns a `ResolvedEngineConfig` holding the validated `_core.ResolvedConfig` and every decision the
policy made. Configuration errors are `hybridserve.ConfigError` with a message naming the flag(s)
to change.

`mamba_block_size` in mode `none`: the resolved value is the auto value (the smallest multiple of
lcm(block_size, scan chunk size) that is at least 256), unused in that mode; an explicit
`--mamba-block-size` with prefix caching off is an error.

This module builds the CLI parser, so it must not import torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import numbers
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from hybridserve import _core
from hybridserve.errors import ConfigError, HybridServeError

__all__ = [
    "DTYPES",
    "CheckpointPlacement",
    "ChunkedPrefillRequest",
    "Decision",
    "EngineArgs",
    "EvictionPolicy",
    "MambaCacheModeRequest",
    "ModelCapabilities",
    "ResolvedEngineConfig",
    "SpecMethod",
    "SpeculativeConfig",
    "add_config_args",
    "add_engine_args",
    "config_main",
    "format_resolved",
    "log_decisions",
    "parse_bytes",
    "read_model_capabilities",
    "resolve_model_dir",
]

logger = logging.getLogger("hybridserve.config")


class MambaCacheModeRequest(StrEnum):
    """`--mamba-cache-mode`. AUTO = not given (an explicit NONE stays distinct)."""

    AUTO = "auto"
    NONE = "none"
    ALIGN = "align"
    ALL = "all"


class CheckpointPlacement(StrEnum):
    """`--mamba-checkpoint-placement`: where Mamba states are kept for prefix hits."""

    BRANCH = "branch"
    GRID = "grid"
    BRANCH_AND_GRID = "branch+grid"


class EvictionPolicy(StrEnum):
    """`--prefix-cache-eviction`: which checkpoint goes when the Mamba pool is full."""

    FLOPS = "flops"
    LRU = "lru"
    LRU_PATH = "lru-path"


class ChunkedPrefillRequest(StrEnum):
    """Chunked prefill as requested: AUTO (not given), ON, OFF."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


class SpecMethod(StrEnum):
    """Speculative decoding methods."""

    NGRAM = "ngram"
    DRAFT_MODEL = "draft_model"


DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
DEFAULT_MAX_QUEUE_LEN = 512
DEFAULT_PROMPT_LOOKUP_MIN = 1
DEFAULT_PROMPT_LOOKUP_MAX = 4
MAX_PROMPT_LOOKUP = 64

# Model types whose layers include Mamba2 mixers, and the scan chunk size each uses by default.
_MAMBA_MODEL_TYPES = {
    "nemotron_h": 128,
    "bamba": 256,
    "mamba2": 256,
    "granitemoehybrid": 256,
    "falcon_h1": 256,
}
_MAMBA_LAYER_NAMES = {"mamba", "mamba2", "linear_attention", "m"}
_ATTN_LAYER_NAMES = {"attention", "full_attention", "*", "hybrid"}


# --------------------------------------------------------------------------- model capabilities


@dataclass(frozen=True)
class ModelCapabilities:
    """What the policy needs to know about a model (read from its config.json)."""

    model_type: str = "unknown"
    #: The model has at least one Mamba layer.
    has_mamba_layers: bool = False
    #: The prefill scan can emit the state at every checkpoint boundary (needed by mode `all`).
    supports_boundary_states: bool = False
    #: Q: the scan chunk size (config.json `chunk_size` / `mamba_chunk_size`); None without Mamba.
    scan_chunk_size: int | None = None
    #: The context limit; caps and defaults `max_model_len`.
    max_position_embeddings: int | None = None
    num_mamba_layers: int = 0
    num_attention_layers: int = 0
    #: config.json `torch_dtype` / `dtype`, if any.
    torch_dtype: str | None = None

    def __post_init__(self) -> None:
        # A wrong type here would surface later as a TypeError or OverflowError from the core,
        # or be read as something else (bool("false") is True): refuse it by name instead.
        def bad(name: str, what: str) -> ConfigError:
            return ConfigError(f"model capabilities: {name} must be {what}, got {getattr(self, name)!r}")

        if not isinstance(self.model_type, str):
            raise bad("model_type", "a string")
        for name in ("has_mamba_layers", "supports_boundary_states"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "true or false")
        for name, lo in (
            ("scan_chunk_size", 1),
            ("max_position_embeddings", 1),
            ("num_mamba_layers", 0),
            ("num_attention_layers", 0),
        ):
            v = getattr(self, name)
            if v is None and name in ("scan_chunk_size", "max_position_embeddings"):
                continue
            if not _is_count(v) or not lo <= v <= _MAX_CAPABILITY_COUNT:
                raise bad(name, f"an integer in [{lo}, 2^40]")
        if self.torch_dtype is not None and not isinstance(self.torch_dtype, str):
            raise bad("torch_dtype", "a string")

    @classmethod
    def coerce(cls, obj: Any) -> ModelCapabilities:
        """A ModelCapabilities from itself, a mapping, or any object with the same attribute names
        (the loader's model config works: `chunk_size` is accepted for `scan_chunk_size`)."""
        if isinstance(obj, ModelCapabilities):
            return obj
        if isinstance(obj, Mapping):
            get = obj.get
        else:

            def get(name: str, default: Any = None) -> Any:
                return getattr(obj, name, default)

        q = get("scan_chunk_size")
        if q is None:
            q = get("chunk_size")
        has_mamba = get("has_mamba_layers", False)
        return cls(
            model_type=str(get("model_type", None) or get("architecture", None) or "unknown"),
            has_mamba_layers=has_mamba,
            supports_boundary_states=get("supports_boundary_states", has_mamba),
            scan_chunk_size=q,
            max_position_embeddings=get("max_position_embeddings"),
            num_mamba_layers=get("num_mamba_layers", 0) or 0,
            num_attention_layers=get("num_attention_layers", 0) or 0,
            torch_dtype=get("torch_dtype"),
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Far above any real model's context or chunk size, and far below what the core's 64-bit
# integers overflow at.
_MAX_CAPABILITY_COUNT = 1 << 40


def _is_count(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _opt_int(v: Any) -> int | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _config_count(cfg: dict[str, Any], key: str, path: Path) -> int | None:
    """config.json `key` as a positive integer, None when absent or null; anything else is an
    error naming the file (not a silent default)."""
    v = cfg.get(key)
    if v is None:
        return None
    if not _is_count(v) or not 1 <= v <= _MAX_CAPABILITY_COUNT:
        raise ConfigError(f"MODEL: {str(path)!r}: {key} must be a positive integer, got {v!r}")
    return int(v)


def _layer_counts(cfg: dict[str, Any], model_type: str) -> tuple[int, int]:
    """(Mamba layers, attention layers) of an HF config."""
    n = _opt_int(cfg.get("num_hidden_layers")) or 0
    kinds = cfg.get("layers_block_type") or cfg.get("layer_types")
    if isinstance(kinds, list) and kinds:
        names = [str(k).lower() for k in kinds]
        return (
            sum(k in _MAMBA_LAYER_NAMES for k in names),
            sum(k in _ATTN_LAYER_NAMES for k in names),
        )
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:
        return pattern.count("M"), pattern.count("*")
    if model_type == "bamba":
        attn = cfg.get("attn_layer_indices") or []
        return max(n - len(attn), 0), len(attn)
    if model_type == "mamba2":
        return n, 0
    if model_type == "falcon_h1":  # every layer runs attention and Mamba in parallel
        return n, n
    if model_type in _MAMBA_MODEL_TYPES:
        return max(n, 1), 0
    return 0, n


def read_model_capabilities(model_dir: str | Path) -> ModelCapabilities:
    """Capabilities from `model_dir/config.json` (HF format).

    Mamba layers: model types nemotron_h, bamba, mamba2, granitemoehybrid, falcon_h1 with at least
    one Mamba layer; their scan supports boundary states. Q = `chunk_size` or `mamba_chunk_size`
    (else the architecture's default). An optional `"hybridserve": {...}` object in config.json
    overrides any field (e.g. `{"supports_boundary_states": false}`).
    """
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"MODEL: no config.json in {str(model_dir)!r} (a model folder, or 'demo')"
        ) from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"MODEL: cannot read {str(path)!r}: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"MODEL: {str(path)!r} is not a JSON object")
    model_type = str(cfg.get("model_type") or "unknown").lower()
    n_mamba, n_attn = _layer_counts(cfg, model_type)
    has_mamba = model_type in _MAMBA_MODEL_TYPES and n_mamba > 0
    q: int | None = None
    if has_mamba:
        q = _config_count(cfg, "chunk_size", path)
        if q is None:
            q = _config_count(cfg, "mamba_chunk_size", path)
        if q is None:
            q = _MAMBA_MODEL_TYPES[model_type]
    values: dict[str, Any] = {
        "model_type": model_type,
        "has_mamba_layers": has_mamba,
        "supports_boundary_states": has_mamba,
        "scan_chunk_size": q,
        "max_position_embeddings": _config_count(cfg, "max_position_embeddings", path),
        "num_mamba_layers": n_mamba if has_mamba else 0,
        "num_attention_layers": n_attn,
        "torch_dtype": cfg.get("torch_dtype") or cfg.get("dtype"),
    }
    overrides = cfg.get("hybridserve")
    if isinstance(overrides, dict):
        known = {f.name for f in dataclasses.fields(ModelCapabilities)}
        values.update({k: v for k, v in overrides.items() if k in known})
    try:
        return ModelCapabilities(**values)
    except ConfigError as e:
        raise ConfigError(f"MODEL: {str(path)!r}: {e}") from None


def resolve_model_dir(model: str) -> str:
    """`"demo"` -> the built-in demo checkpoint (created offline on first use); else unchanged."""
    if model == "demo":
        from hybridserve.model import demo

        ensure = getattr(demo, "ensure_demo_model", None)
        if ensure is None:
            raise ConfigError("MODEL: the demo model is not available in this build")
        return str(ensure())
    return model


# --------------------------------------------------------------------------- speculative config


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config` after validation."""

    method: SpecMethod
    #: K: draft tokens proposed per step (1..MAX_SPECULATIVE_TOKENS).
    num_speculative_tokens: int
    #: The draft model folder (method `draft_model` only; required there).
    model: str | None = None
    #: n-gram sizes tried by prompt lookup (method `ngram` only).
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    _KEYS = ("method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SpeculativeConfig:
        """Validates the dict form; a ConfigError names the offending key."""
        flag = "--speculative-config"
        if not isinstance(d, Mapping):
            raise ConfigError(f"{flag} must be a JSON object, got {type(d).__name__}")
        unknown = sorted(str(k) for k in d if k not in cls._KEYS)
        if unknown:
            raise ConfigError(
                f"{flag}: unknown key(s) {', '.join(map(repr, unknown))}; known keys: {', '.join(cls._KEYS)}"
            )
        if "method" not in d:
            raise ConfigError(f'{flag}: \'method\' is required ("ngram" or "draft_model")')
        try:
            method = SpecMethod(d["method"])
        except ValueError:
            raise ConfigError(
                f'{flag}: \'method\' must be "ngram" or "draft_model", got {d["method"]!r}'
            ) from None
        if "num_speculative_tokens" not in d:
            raise ConfigError(f"{flag}: 'num_speculative_tokens' is required")
        k = d["num_speculative_tokens"]
        limit = _core.MAX_SPECULATIVE_TOKENS
        if not _is_int(k) or not 1 <= k <= limit:
            raise ConfigError(f"{flag}: 'num_speculative_tokens' must be an integer in 1..{limit}, got {k!r}")
        model = d.get("model")
        lo = d.get("prompt_lookup_min")
        hi = d.get("prompt_lookup_max")
        if method is SpecMethod.DRAFT_MODEL:
            if not isinstance(model, str) or not model:
                raise ConfigError(
                    f"{flag}: 'model' (the draft model folder) is required for method draft_model"
                )
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                if d.get(key) is not None:
                    raise ConfigError(f"{flag}: {key!r} applies to method ngram only")
            return cls(method, int(k), model=model)
        if model is not None:
            raise ConfigError(f"{flag}: 'model' applies to method draft_model only")
        for key, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None and (not _is_int(v) or not 1 <= v <= MAX_PROMPT_LOOKUP):
                raise ConfigError(f"{flag}: {key!r} must be an integer in 1..{MAX_PROMPT_LOOKUP}, got {v!r}")
        if lo is None and hi is None:
            lo, hi = DEFAULT_PROMPT_LOOKUP_MIN, DEFAULT_PROMPT_LOOKUP_MAX
        elif lo is None:
            lo = min(DEFAULT_PROMPT_LOOKUP_MIN, hi)
        elif hi is None:
            hi = max(DEFAULT_PROMPT_LOOKUP_MAX, lo)
        if lo > hi:
            raise ConfigError(f"{flag}: 'prompt_lookup_min' ({lo}) must be <= 'prompt_lookup_max' ({hi})")
        return cls(method, int(k), prompt_lookup_min=int(lo), prompt_lookup_max=int(hi))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "method": str(self.method),
            "num_speculative_tokens": self.num_speculative_tokens,
        }
        if self.model is not None:
            out["model"] = self.model
        if self.prompt_lookup_min is not None:
            out["prompt_lookup_min"] = self.prompt_lookup_min
            out["prompt_lookup_max"] = self.prompt_lookup_max
        return out


# Largest accepted values of the integer flags (beyond them nothing can be allocated or indexed;
# the Rust core takes 32-bit counts and 64-bit byte sizes).
_UPPER_BOUNDS = {
    "block_size": 2**20,
    "max_num_seqs": 2**20,
    "max_queue_len": 2**31 - 1,
    "mamba_block_size": 2**20,
    "max_num_batched_tokens": 2**31 - 1,
    "max_model_len": 2**31 - 1,
    "num_kv_blocks": 2**31 - 1,
    "num_mamba_slots": 2**31 - 1,
    "kv_cache_memory": 2**62,
    "mamba_cache_memory": 2**62,
    "cache_memory": 2**62,
    "cpu_threads": 1024,
    "seed": 2**64 - 1,
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# --------------------------------------------------------------------------- engine args


@dataclass(frozen=True)
class Decision:
    """One decision of the policy: `code` (stable id), `level` ("info" | "warning"), `message`."""

    code: str
    level: str
    message: str

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "level": self.level, "message": self.message}


@dataclass
class EngineArgs:
    """Everything that configures an engine. Field names are the CLI flags with underscores;
    None means "not given" (the policy or the model decides, and says so in a decision)."""

    #: Model folder (HF config.json + safetensors + tokenizer.json), or "demo".
    model: str
    #: Prefix caching of the KV cache and the Mamba state. None = auto (on).
    enable_prefix_caching: bool | None = None
    #: "auto" | "none" | "align" | "all" (DESIGN.md §4, §5).
    mamba_cache_mode: str = MambaCacheModeRequest.AUTO
    #: Where Mamba checkpoints are kept: "branch" (where prompts share a prefix, and at the last
    #: token of every finished sequence), "grid" (every mamba_block_size tokens), "branch+grid".
    #: None = auto (branch).
    mamba_checkpoint_placement: str | None = None
    #: Which checkpoint goes when the state pool is full: "flops" (recency and FLOPs saved per
    #: byte), "lru", "lru-path" (LRU refreshing a hit's whole path). None = auto (flops).
    prefix_cache_eviction: str | None = None
    #: Chunked prefill. None = auto (on; `align` requires it).
    enable_chunked_prefill: bool | None = None
    #: {"method": "ngram" | "draft_model", "num_speculative_tokens": K, "model": draft folder,
    #: "prompt_lookup_min": n, "prompt_lookup_max": n}; None = no speculative decoding.
    speculative_config: dict[str, Any] | None = None
    #: B: tokens per KV block.
    block_size: int = _core.DEFAULT_BLOCK_SIZE
    #: M: tokens between Mamba checkpoints. None = auto (smallest multiple of lcm(B, Q) >= 256).
    mamba_block_size: int | None = None
    #: Most sequences running at once.
    max_num_seqs: int = _core.DEFAULT_MAX_NUM_SEQS
    #: Token budget per step. None = auto (2048; >= M in align; >= max_model_len without chunked prefill).
    max_num_batched_tokens: int | None = None
    #: Longest sequence (prompt + output). None = the model's max_position_embeddings.
    max_model_len: int | None = None
    #: Weights and activations: "auto" (config.json torch_dtype when float32/bfloat16/float16, else
    #: float32) | "float32" | "bfloat16" | "float16" | "float64".
    dtype: str = "auto"
    #: "cpu", "cuda", "cuda:N"; None = auto (the engine decides).
    device: str | None = None
    #: Seed of the engine (sampling of requests without their own seed; hashing).
    seed: int = 0
    #: Bytes for the KV cache. None = the engine's default sizing.
    kv_cache_memory: int | None = None
    #: Bytes for the Mamba state cache. None = the engine's default sizing.
    mamba_cache_memory: int | None = None
    #: Bytes for both caches together, split as engine/sizing.py documents (with one of the two
    #: budgets above, the other pool gets the rest). None = no total.
    cache_memory: int | None = None
    #: Exact number of KV blocks (counting the null block), overriding kv_cache_memory.
    num_kv_blocks: int | None = None
    #: Exact number of Mamba state slots (counting the null slot), overriding mamba_cache_memory.
    num_mamba_slots: int | None = None
    #: Requests admitted at once by the server (running + waiting); beyond it, 503.
    max_queue_len: int = DEFAULT_MAX_QUEUE_LEN
    #: torch's intra-op CPU threads (torch.set_num_threads, process-wide). None = torch's default.
    #: On a shared or small machine 1 is often fastest: spinning OpenMP threads lose to other load.
    cpu_threads: int | None = None
    #: Run the Mamba layers' plain decode steps on the CPU through torch.compile'd kernels
    #: (kernels/compiled.py): faster steps, seconds of compilation on the first decode step.
    compile_cpu_kernels: bool = False

    # ---- validation of the fields that never reach Rust
    def validate(self) -> None:
        """Type and range checks; ConfigError names the flag."""
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("MODEL: a model folder or 'demo' is required")
        for name in ("enable_prefix_caching", "enable_chunked_prefill"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ConfigError(f"{_flag(name)} must be True, False or None (auto), got {v!r}")
        if not isinstance(self.compile_cpu_kernels, bool):
            raise ConfigError(
                f"--compile-cpu-kernels must be True or False, got {self.compile_cpu_kernels!r}"
            )
        try:
            MambaCacheModeRequest(self.mamba_cache_mode)
        except ValueError:
            raise ConfigError(
                f"--mamba-cache-mode must be one of auto, none, align, all; got {self.mamba_cache_mode!r}"
            ) from None
        for name, enum in (
            ("mamba_checkpoint_placement", CheckpointPlacement),
            ("prefix_cache_eviction", EvictionPolicy),
        ):
            v = getattr(self, name)
            if v is not None and v not in {e.value for e in enum}:
                raise ConfigError(
                    f"{_flag(name)} must be one of {', '.join(e.value for e in enum)}; got {v!r}"
                )
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.device is not None and not (
            isinstance(self.device, str) and re.fullmatch(r"cpu|cuda(:\d+)?", self.device)
        ):
            raise ConfigError(f"--device must be cpu, cuda or cuda:N; got {self.device!r}")
        required = {"block_size": 1, "max_num_seqs": 1, "seed": 0, "max_queue_len": 1}
        optional = {
            "mamba_block_size": 1,
            "max_num_batched_tokens": 1,
            "max_model_len": 1,
            "kv_cache_memory": 1,
            "mamba_cache_memory": 1,
            "cache_memory": 1,
            "num_kv_blocks": 2,
            "num_mamba_slots": 1,
            "cpu_threads": 1,
        }
        for name, lo in [*required.items(), *optional.items()]:
            v = getattr(self, name)
            if v is None and name in optional:
                continue
            hi = _UPPER_BOUNDS.get(name)
            if not _is_int(v) or v < lo or (hi is not None and v > hi):
                within = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
                shown = v if not _is_int(v) or abs(v) < 10**30 else f"a {len(str(abs(v)))}-digit number"
                raise ConfigError(f"{_flag(name)} must be an integer {within}, got {shown!r}")
        if self.cache_memory is not None and None not in (self.kv_cache_memory, self.mamba_cache_memory):
            raise ConfigError(
                "--cache-memory is the total of --kv-cache-memory and --mamba-cache-memory: give at most one of them with it"
            )
        self.speculative()

    def speculative(self) -> SpeculativeConfig | None:
        """The validated speculative config (None without speculative decoding)."""
        sc = self.speculative_config
        if sc is None:
            return None
        if isinstance(sc, str):
            sc = _parse_speculative_json(sc)
        return SpeculativeConfig.from_dict(sc)

    def resolve(self, caps: Any = None) -> ResolvedEngineConfig:
        """Resolves the policy against the model's capabilities (a ModelCapabilities, a mapping or
        an object with the same attributes; None reads them from the model folder)."""
        self.validate()
        model_dir: str | None = None
        if caps is None:
            model_dir = resolve_model_dir(self.model)
            caps = read_model_capabilities(model_dir)
        caps = ModelCapabilities.coerce(caps)
        spec = self.speculative()
        core = _core.resolve_policy(
            has_mamba_layers=caps.has_mamba_layers,
            supports_boundary_states=caps.supports_boundary_states,
            scan_chunk_size=caps.scan_chunk_size,
            max_position_embeddings=caps.max_position_embeddings,
            enable_prefix_caching=self.enable_prefix_caching,
            mamba_cache_mode=str(self.mamba_cache_mode),
            enable_chunked_prefill=self.enable_chunked_prefill,
            speculative_method=None if spec is None else str(spec.method),
            num_speculative_tokens=0 if spec is None else spec.num_speculative_tokens,
            block_size=self.block_size,
            mamba_block_size=self.mamba_block_size,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            mamba_checkpoint_placement=(
                None if self.mamba_checkpoint_placement is None else str(self.mamba_checkpoint_placement)
            ),
            prefix_cache_eviction=None
            if self.prefix_cache_eviction is None
            else str(self.prefix_cache_eviction),
        )
        huge = 1 << 62
        if self.num_kv_blocks is not None:
            core.validate_pool_sizes(self.num_kv_blocks, huge)
        if self.num_mamba_slots is not None:
            core.validate_pool_sizes(huge, self.num_mamba_slots)
            from hybridserve.engine.sizing import min_mamba_slots

            # the engine keeps a window for every sequence that may run (engine/sizing.py): a
            # pool that the engine would refuse at start is refused here already
            seqs, k = int(core.max_num_seqs), int(core.num_speculative_tokens)
            need = min_mamba_slots(seqs, k, bool(core.has_mamba_layers))
            if self.num_mamba_slots < need:
                raise ConfigError(
                    f"--num-mamba-slots {self.num_mamba_slots}: {seqs} running sequences with windows "
                    f"of {1 + k} slots need {need}, counting the null slot; raise it or lower --max-num-seqs"
                )
        decisions = [Decision(d.code, d.level, d.message) for d in core.decisions]
        dtype = self.dtype
        if dtype == "auto":
            declared = str(caps.torch_dtype) if caps.torch_dtype else None
            dtype = declared if declared in ("float32", "bfloat16", "float16") else "float32"
            why = f"the model's torch_dtype {declared}" if declared == dtype else "default"
            decisions.append(Decision("dtype_auto", "info", f"dtype = {dtype} ({why})"))
        if spec is not None and spec.method is SpecMethod.NGRAM:
            given = self.speculative_config or {}
            if isinstance(given, str):
                given = _parse_speculative_json(given)
            if not isinstance(given, Mapping) or (
                "prompt_lookup_min" not in given or "prompt_lookup_max" not in given
            ):
                decisions.append(
                    Decision(
                        "prompt_lookup_default",
                        "info",
                        f"ngram prompt lookup tries n-grams of {spec.prompt_lookup_min}..{spec.prompt_lookup_max} tokens",
                    )
                )
        return ResolvedEngineConfig(
            core=core,
            args=self,
            capabilities=caps,
            model_dir=model_dir,
            dtype=dtype,
            speculative=spec,
            decisions=decisions,
        )

    def to_dict(self) -> dict[str, Any]:
        """The fields as given (JSON-serialisable)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}
        out["mamba_cache_mode"] = str(self.mamba_cache_mode)
        return out

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> EngineArgs:
        """From a namespace built by a parser that `add_engine_args` set up. Missing attributes take
        the field defaults, so a parser with only some of the flags works too."""
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name.startswith("_") or not hasattr(ns, f.name):
                continue
            kwargs[f.name] = getattr(ns, f.name)
        if "model" not in kwargs:
            kwargs["model"] = "demo"
        sc = kwargs.get("speculative_config")
        if isinstance(sc, str):
            kwargs["speculative_config"] = _parse_speculative_json(sc)
        for name in ("kv_cache_memory", "mamba_cache_memory", "cache_memory"):
            v = kwargs.get(name)
            if isinstance(v, str):
                kwargs[name] = parse_bytes(v, _flag(name))
        mode = kwargs.get("mamba_cache_mode")
        if mode is None:
            kwargs.pop("mamba_cache_mode", None)
        for name in ("block_size", "max_num_seqs", "seed", "dtype", "max_queue_len"):
            if kwargs.get(name, 0) is None:
                kwargs.pop(name)
        args = cls(**kwargs)
        args.validate()
        return args


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse_speculative_json(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"--speculative-config must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--speculative-config must be a JSON object, got {text!r}")
    return value


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12}


def parse_bytes(text: str, flag: str = "memory") -> int:
    """'1073741824', '512MiB', '4GiB', '1.5GB' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ConfigError(f"{flag} must be a byte count such as 1073741824, 512MiB or 4GiB; got {text!r}")
    value = math.floor(float(m.group(1)) * _UNITS[unit])
    if value < 1:
        raise ConfigError(f"{flag} must be at least 1 byte; got {text!r}")
    return value


# --------------------------------------------------------------------------- resolved config


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
        out = dict(self.core.to_dict())
        a = self.args
        out.update(
            {
                "model": a.model,
                "model_dir": self.model_dir,
                "dtype": self.dtype,
                "device": a.device,
                "seed": a.seed,
                "speculative": None if self.speculative is None else self.speculative.to_dict(),
                "kv_cache_memory": a.kv_cache_memory,
                "mamba_cache_memory": a.mamba_cache_memory,
                "cache_memory": a.cache_memory,
                "num_kv_blocks": a.num_kv_blocks,
                "num_mamba_slots": a.num_mamba_slots,
                "max_queue_len": a.max_queue_len,
                "compile_cpu_kernels": a.compile_cpu_kernels,
                "cpu_threads": a.cpu_threads,
                "capabilities": self.capabilities.to_dict(),
                "decisions": [d.to_dict() for d in self.decisions],
            }
        )
        return out


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


# --------------------------------------------------------------------------- CLI


def add_engine_args(p: argparse.ArgumentParser, *, model_positional: bool = True) -> None:
    """Adds every engine flag (vLLM names) to `p`, and the MODEL positional unless `p` has one or
    `model_positional` is False. `--max-queue-len` is left to the server (and `config`)."""
    if model_positional and not any(a.dest == "model" for a in p._actions):
        p.add_argument("model", help="model folder (HF config.json + safetensors), or 'demo'")
    g = p.add_argument_group("engine")
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prefix caching of the KV cache and the Mamba state (default: on)",
    )
    g.add_argument(
        "--mamba-cache-mode",
        choices=[m.value for m in MambaCacheModeRequest],
        default="auto",
        help="how Mamba states are checkpointed for prefix hits (default: auto; see `hybridserve config --explain`)",
    )
    g.add_argument(
        "--mamba-checkpoint-placement",
        choices=[m.value for m in CheckpointPlacement],
        default=None,
        help="where Mamba states are kept for prefix hits: branch (where prompts share a prefix, and at the "
        "last token of finished sequences), grid (every --mamba-block-size tokens), branch+grid (default: branch)",
    )
    g.add_argument(
        "--prefix-cache-eviction",
        choices=[m.value for m in EvictionPolicy],
        default=None,
        help="which Mamba checkpoint goes when the state pool is full: flops (recency and prefill FLOPs saved "
        "per byte), lru, lru-path (LRU refreshing a hit's whole path) (default: flops)",
    )
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="split long prompts over several steps (default: on; mamba cache mode align requires it)",
    )
    g.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' or '
        '\'{"method": "draft_model", "model": "DIR", "num_speculative_tokens": 3}\'',
    )
    g.add_argument(
        "--block-size", type=int, default=_core.DEFAULT_BLOCK_SIZE, help="tokens per KV block (default: 16)"
    )
    g.add_argument(
        "--mamba-block-size",
        type=int,
        default=None,
        help="tokens between grid Mamba checkpoints (default: the smallest multiple of lcm(block size, scan chunk) >= 256)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=_core.DEFAULT_MAX_NUM_SEQS,
        help="most running sequences (default: 64)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget per step (default: 2048, raised where the configuration needs more)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest sequence (default: the model's max_position_embeddings)",
    )
    g.add_argument("--dtype", choices=list(DTYPES), default="auto", help="model dtype (default: auto)")
    g.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: auto)")
    g.add_argument("--seed", type=int, default=0, help="engine seed (default: 0)")
    g.add_argument("--kv-cache-memory", default=None, metavar="BYTES", help="KV cache budget, e.g. 2GiB")
    g.add_argument(
        "--mamba-cache-memory", default=None, metavar="BYTES", help="Mamba state cache budget, e.g. 1GiB"
    )
    g.add_argument(
        "--cache-memory",
        default=None,
        metavar="BYTES",
        help="both caches together, e.g. 3GiB (split: see engine/sizing.py; with one of the two budgets above, the other gets the rest)",
    )
    g.add_argument(
        "--num-kv-blocks", type=int, default=None, help="exact KV block count (overrides --kv-cache-memory)"
    )
    g.add_argument(
        "--num-mamba-slots",
        type=int,
        default=None,
        help="exact Mamba slot count (overrides --mamba-cache-memory)",
    )
    g.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="torch CPU threads for the engine (default: torch's choice; 1 is often fastest on a loaded machine)",
    )
    g.add_argument(
        "--compile-cpu-kernels",
        action="store_true",
        help="torch.compile the Mamba decode on the CPU where the C++ CPU kernels are off or unavailable "
        "(HYBRIDSERVE_NATIVE_CPU=0, no compiler); the first decode step compiles",
    )


def add_config_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument(
        "--max-queue-len",
        type=int,
        default=DEFAULT_MAX_QUEUE_LEN,
        help="server admission limit (default: 512)",
    )
    out = p.add_mutually_exclusive_group()
    out.add_argument("--explain", action="store_true", help="also print every decision with its reason")
    out.add_argument("--json", action="store_true", help="print one JSON object")


def _one_paragraph(text: str) -> str:
    return " ".join(str(text).split())


def config_main(args: argparse.Namespace) -> int:
    """`hybridserve config MODEL [flags] [--explain | --json]`; exit 2 on a configuration error."""
    try:
        engine_args = EngineArgs.from_cli(args)
        resolved = engine_args.resolve()
    except HybridServeError as e:
        print(f"hybridserve config: {type(e).__name__}: {_one_paragraph(str(e))}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(resolved.to_dict(), indent=2))
    else:
        print(format_resolved(resolved, explain=args.explain))
    return 0
