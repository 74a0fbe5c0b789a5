"""`EngineArgs`: everything that configures an engine, validated; `resolve` runs the Rust
cache-mode policy (`rust/policy.rs`; docs/cache-modes.md) against the model's capabilities.

The names each enum setting accepts and the range of every integer setting the core checks come
from the core (`_core.MAMBA_CACHE_MODES`, `_core.FLAG_LIMITS`, ...): one rule, written in Rust.
The settings that never reach Rust (memory budgets, threads, the server's queue) are bounded here.

`mamba_block_size` in mode `none`: the resolved value is the auto value (the smallest multiple of
lcm(block_size, scan chunk size) that is at least 256), unused in that mode; an explicit
`--mamba-block-size` with prefix caching off is an error.

This module is imported by the CLI parser, so it must not import torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridserve import _core
from hybridserve.config.capabilities import ModelCapabilities, read_model_capabilities, resolve_model_dir
from hybridserve.config.explain import Decision, ResolvedEngineConfig
from hybridserve.config.generation import check_setting as check_generation_setting
from hybridserve.config.generation import parse_override as parse_generation_override
from hybridserve.config.generation import sampling_defaults
from hybridserve.config.kv_events import KVEventsConfig
from hybridserve.config.sizing import min_mamba_slots
from hybridserve.config.speculative import SpeculativeConfig, parse_speculative_json
from hybridserve.errors import ConfigError
from hybridserve.sampling.params import DEFAULT_MAX_LOGPROBS

if TYPE_CHECKING:
    from hybridserve._core import CheckpointPlacementName, EvictionPolicyName, MambaCacheModeName

DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
# vLLM's other names of them (--dtype half, a torch.dtype in LLM(...))
DTYPE_ALIASES = {"half": "float16", "float": "float32", "double": "float64"}


def dtype_name(v: Any) -> Any:
    """A dtype as DTYPES names it: vLLM's aliases and torch dtypes to their names; anything else
    as it is (for the check to refuse)."""
    if not isinstance(v, str) and type(v).__name__ == "dtype":  # (torch.float32: no torch import)
        v = str(v).removeprefix("torch.")
    return DTYPE_ALIASES.get(v, v) if isinstance(v, str) else v


# --mamba-ssm-cache-dtype: the Mamba states' dtype (vLLM's flag; "auto" reads the checkpoint).
# Not vLLM's bfloat16 / float16: the native CPU step and the CUDA kernels take float32 states only,
# so such states would run every Mamba layer on the torch ops (which compute them in float32).
STATE_DTYPES = ("auto", "float32")
# --kv-cache-dtype: the KV cache's dtype (vLLM's flag and names; "fp8" is fp8_e4m3). "auto" is the
# model dtype. K and V are rounded to it when written and widened to the model dtype when read, by
# every attention path alike, so prefix hits and chunking still never change an output.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
DEFAULT_MAX_QUEUE_LEN = 512
# --load-format (vLLM's names): "auto" and "safetensors" read the checkpoint's weights, "dummy"
# fills them with small random numbers (for measuring speed on a model's shapes without its
# weights; what it says is noise)
LOAD_FORMATS = ("auto", "safetensors", "dummy")

# Largest accepted values of the integer settings that never reach the core's policy (beyond
# them nothing can be allocated; the core takes 64-bit byte sizes and seeds).
_PYTHON_UPPER_BOUNDS = {
    "max_queue_len": 2**31 - 1,
    "kv_cache_memory": 2**62,
    "mamba_cache_memory": 2**62,
    "cache_memory": 2**62,
    "cpu_threads": 1024,
    "tensor_parallel_size": 1024,
    "seed": 2**64 - 1,
    "prefix_cache_hash_seed": 2**64 - 1,
    "max_logprobs": 2**31 - 1,
}
_PYTHON_LOWER_BOUNDS = {
    "max_queue_len": 1,
    "kv_cache_memory": 1,
    "mamba_cache_memory": 1,
    "cache_memory": 1,
    "cpu_threads": 1,
    "tensor_parallel_size": 1,
    "seed": 0,
    "prefix_cache_hash_seed": 0,
    "max_logprobs": -1,
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _limits(name: str) -> tuple[int, int]:
    """(smallest, largest) accepted value of integer setting `name`."""
    core = _core.FLAG_LIMITS.get(name)
    if core is not None:
        return core
    return _PYTHON_LOWER_BOUNDS[name], _PYTHON_UPPER_BOUNDS[name]


@dataclass
class EngineArgs:
    """Everything that configures an engine. Field names are the CLI flags with underscores;
    None means "not given" (the policy or the model decides, and says so in a decision)."""

    #: Model folder (HF config.json + safetensors + tokenizer.json), or "demo".
    model: str
    #: The folder of the tokenizer (tokenizer.json, tokenizer_config.json and its chat template),
    #: as vLLM's --tokenizer. None = the model folder.
    tokenizer: str | None = None
    #: Where the weights come from: "auto" / "safetensors" (the checkpoint's), or "dummy" (small
    #: random numbers, seeded: a model's speed without its weights; config.json is enough).
    load_format: str = "auto"
    #: Prefix caching of the KV cache and the Mamba state. None = auto (on).
    enable_prefix_caching: bool | None = None
    #: "auto" | "none" | "align" | "all" (docs/cache-modes.md, "Modes").
    mamba_cache_mode: MambaCacheModeName = "auto"
    #: Where Mamba checkpoints are kept: "branch" (where prompts share a prefix, and at the last
    #: token of every finished sequence), "grid" (every mamba_block_size tokens), "branch+grid".
    #: None = auto ("branch+grid" in mode all, "branch" in align).
    mamba_checkpoint_placement: CheckpointPlacementName | None = None
    #: Which checkpoint goes when the state pool is full: "flops" (recency and FLOPs saved per
    #: byte), "lru", "lru-path" (LRU refreshing a hit's whole path). None = auto (flops).
    prefix_cache_eviction: EvictionPolicyName | None = None
    #: Token ids that end a chat message: a prompt up to the first of them (its system message) is
    #: declared shared, and the first request to compute it keeps the Mamba state there, so that
    #: the second user already hits it (engine/shared_prefix.py). "auto" = the chat template's
    #: end-of-message token, "none", or token ids ("2,7", or a list).
    shared_prefix_markers: str | Sequence[int] = "auto"
    #: The chat template to serve instead of the model's: a file holding a Jinja template, or the
    #: template itself (vLLM's --chat-template). The chat routes, `LLM.chat` and the "auto"
    #: shared-prefix markers use it. None = the model's (tokenizer_config.json, else ChatML).
    chat_template: str | None = None
    #: How the chat template is handed a message's content (vLLM's --chat-template-content-format):
    #: "string", "openai" (a list of {"type": "text", "text": ...} parts) or "auto" (the list for
    #: a template that loops over a message's content, else the string).
    chat_template_content_format: str = "auto"
    #: Where default sampling parameters come from (config/generation.py): "auto" (the model's
    #: generation_config.json, as vLLM), "vllm" (none: SamplingParams' own defaults), or a folder
    #: holding a generation_config.json.
    generation_config: str = "auto"
    #: Generation-config fields set over it (temperature, top_p, top_k, min_p,
    #: repetition_penalty, max_new_tokens), a JSON object or a dict.
    override_generation_config: dict[str, Any] | str | None = None
    #: Chunked prefill. None = auto (on; `align` requires it).
    enable_chunked_prefill: bool | None = None
    #: {"method": "ngram" | "draft_model", "num_speculative_tokens": K, "model": draft folder,
    #: "prompt_lookup_min": n, "prompt_lookup_max": n}; None = no speculative decoding.
    speculative_config: dict[str, Any] | None = None
    #: B: tokens per KV block.
    block_size: int = _core.DEFAULT_BLOCK_SIZE
    #: M: tokens between Mamba checkpoints. None = auto (smallest multiple of lcm(B, Q) >= 256).
    mamba_block_size: int | None = None
    #: Most sequences running at once. None = auto: the default (64), lowered to the sequences the
    #: Mamba state pool can run (config/sizing.py `state_pool_capacity`).
    max_num_seqs: int | None = None
    #: Token budget per step. None = auto (2048; >= M in align; >= max_model_len without chunked prefill).
    max_num_batched_tokens: int | None = None
    #: Longest sequence (prompt + output). None = the model's max_position_embeddings.
    max_model_len: int | None = None
    #: Weights and activations: "auto" (config.json torch_dtype when float32/bfloat16/float16, else
    #: float32) | "float32" | "bfloat16" | "float16" | "float64".
    dtype: str = "auto"
    #: The Mamba states' dtype (SSM and conv states): "auto" (the checkpoint's
    #: `mamba_ssm_cache_dtype`, else float32; not the model dtype, as vLLM's auto: a recurrence
    #: kept in bfloat16 drifts) | "float32" (also over a checkpoint that asks for less). A float64
    #: model keeps float64 states whatever this says.
    mamba_ssm_cache_dtype: str = "auto"
    #: The KV cache's dtype: "auto" (the model dtype) | "float32" | "bfloat16" | "float16" | "fp8"
    #: (= "fp8_e4m3") | "fp8_e5m2". K and V are rounded to it when written (fp8 without scales,
    #: e4m3 saturating at +-448, as vLLM's with a scale of 1); every attention path reads the
    #: rounded values, so caching stays lossless.
    kv_cache_dtype: str = "auto"
    #: "cpu", "cuda", "cuda:N"; None = auto (the engine decides).
    device: str | None = None
    #: N: tensor-parallel ranks (processes) the model is split over; the engine process is rank 0
    #: and spawns the others (docs/tensor-parallelism.md).
    tensor_parallel_size: int = 1
    #: Seed of the engine's sampling (requests without their own seed).
    seed: int = 0
    #: Secret seed of the prefix cache's block hashes (a hit is trusted on the hash, so the seed
    #: must not be guessable by a client). None = drawn from the OS at every engine start.
    prefix_cache_hash_seed: int | None = None
    #: Bytes for the KV cache (given as a count, or as a size the flag takes, "2GiB": read into
    #: bytes on construction). None = the engine's default sizing.
    kv_cache_memory: int | None = None
    #: Bytes for the Mamba state cache (as kv_cache_memory). None = the engine's default sizing.
    mamba_cache_memory: int | None = None
    #: Bytes for both caches together, split as config/sizing.py documents (with one of the two
    #: budgets above, the other pool gets the rest; as kv_cache_memory). None = no total.
    cache_memory: int | None = None
    #: vLLM's fraction of a GPU's memory for weights, activations and caches. Accepted on the CPU,
    #: where it changes nothing (as on vLLM's CPU build: the budgets above size the caches);
    #: refused on a CUDA device, where the caches are not yet sized from it. None = not given.
    gpu_memory_utilization: float | None = None
    #: Exact number of KV blocks (counting the null block), overriding kv_cache_memory.
    num_kv_blocks: int | None = None
    #: Exact number of Mamba state slots (counting the null slot), overriding mamba_cache_memory.
    num_mamba_slots: int | None = None
    #: Requests admitted at once by the server (running + waiting); beyond it, 503.
    max_queue_len: int = DEFAULT_MAX_QUEUE_LEN
    #: torch's intra-op CPU threads (torch.set_num_threads, process-wide), also the C++ kernels'.
    #: None = engine/cpu_threads.py's default: the usable cores minus one (spinning OpenMP threads
    #: lose badly to any other load on their cores), or torch's own with OMP_NUM_THREADS set.
    cpu_threads: int | None = None
    #: Overlapped steps: a step of decode rows computes on a background thread while the engine
    #: builds the previous step's outputs (engine/llm_engine.py). None = auto: on when the native
    #: decode step runs the model and a core is left beside the compute threads.
    async_scheduling: bool | None = None
    #: False: on a GPU, steps of decode and verify rows replay CUDA graphs (model/cuda_graphs.py);
    #: True: every step runs eagerly. None = eager for now: the graphs' capture has not yet run on
    #: a device in tests/gpu. Nothing changes on the CPU.
    enforce_eager: bool | None = None
    #: Seconds a structured-output grammar may take to compile; a request whose grammar takes
    #: longer is refused (engine/grammar_compiler.py).
    grammar_compile_timeout: float = 10.0
    #: Most log-probabilities a request may ask for per token (`logprobs`, `prompt_logprobs`,
    #: `top_logprobs`), as vLLM's --max-logprobs; -1 = the vocabulary. A request over it is refused.
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    #: KV cache events for routers: vLLM's KVEventsConfig fields (config/kv_events.py), as a dict,
    #: a KVEventsConfig or the JSON text of --kv-events-config. None = no events.
    kv_events_config: KVEventsConfig | dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        # vLLM's spellings: its dtype aliases and torch dtypes; seed None (its default) is the
        # engine's own seed
        self.dtype = dtype_name(self.dtype)
        if self.seed is None:
            self.seed = 0
        # the memory budgets as the flags take them too ("512MiB", "4GiB"), in bytes from here on
        for name in ("kv_cache_memory", "mamba_cache_memory", "cache_memory"):
            value: object = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, parse_bytes(value, _flag(name)))

    # ---- validation of the fields that never reach Rust
    def validate(self) -> None:
        """Type and range checks; ConfigError names the flag."""
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("MODEL: a model folder or 'demo' is required")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "async_scheduling", "enforce_eager"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ConfigError(f"{_flag(name)} must be True, False or None (auto), got {v!r}")
        for name, names, may_be_none in (
            ("mamba_cache_mode", _core.MAMBA_CACHE_MODES, False),
            ("mamba_checkpoint_placement", _core.CHECKPOINT_PLACEMENTS, True),
            ("prefix_cache_eviction", _core.EVICTION_POLICIES, True),
        ):
            v = getattr(self, name)
            if not (v is None and may_be_none) and v not in names:
                raise ConfigError(f"{_flag(name)} must be one of {', '.join(names)}; got {v!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.mamba_ssm_cache_dtype not in STATE_DTYPES:
            raise ConfigError(
                f"--mamba-ssm-cache-dtype must be one of {', '.join(STATE_DTYPES)}; got {self.mamba_ssm_cache_dtype!r}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(
                f"--load-format must be one of {', '.join(LOAD_FORMATS)}; got {self.load_format!r}"
            )
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str) or not self.tokenizer):
            raise ConfigError(f"--tokenizer must be a folder, got {self.tokenizer!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}"
            )
        if self.device is not None and not (
            isinstance(self.device, str) and re.fullmatch(r"cpu|cuda(:\d+)?", self.device)
        ):
            raise ConfigError(f"--device must be cpu, cuda or cuda:N; got {self.device!r}")
        required = ("block_size", "seed", "max_queue_len", "tensor_parallel_size", "max_logprobs")
        optional = (
            "max_num_seqs",
            "mamba_block_size",
            "max_num_batched_tokens",
            "max_model_len",
            "kv_cache_memory",
            "mamba_cache_memory",
            "cache_memory",
            "num_kv_blocks",
            "num_mamba_slots",
            "cpu_threads",
            "prefix_cache_hash_seed",
        )
        for name in (*required, *optional):
            v = getattr(self, name)
            if v is None and name in optional:
                continue
            lo, hi = _limits(name)
            if not _is_int(v) or v < lo or v > hi:
                within = f"in [{lo}, {hi}]"
                shown = v if not _is_int(v) or abs(v) < 10**30 else f"a {len(str(abs(v)))}-digit number"
                raise ConfigError(f"{_flag(name)} must be an integer {within}, got {shown!r}")
        if self.cache_memory is not None and None not in (self.kv_cache_memory, self.mamba_cache_memory):
            raise ConfigError(
                "--cache-memory is the total of --kv-cache-memory and --mamba-cache-memory: give at most one of them with it"
            )
        u = self.gpu_memory_utilization
        if u is not None and (isinstance(u, bool) or not isinstance(u, int | float) or not (0 < u <= 1)):
            raise ConfigError(f"--gpu-memory-utilization must be a fraction in (0, 1], got {u!r}")
        if u is not None and str(self.device or "cpu").startswith("cuda"):
            raise ConfigError(
                "--gpu-memory-utilization: the caches are not sized from a fraction of device memory "
                "here; give their memory instead (--cache-memory, or --kv-cache-memory and "
                "--mamba-cache-memory)"
            )
        t = self.grammar_compile_timeout
        if isinstance(t, bool) or not isinstance(t, int | float) or not (0 < t <= 3600):
            raise ConfigError(
                f"--grammar-compile-timeout must be a number of seconds in (0, 3600], got {t!r}"
            )
        self.speculative()
        self.kv_events()
        parse_shared_prefix_markers(self.shared_prefix_markers)
        if self.chat_template is not None:
            check_chat_template(self.chat_template)
        if self.chat_template_content_format not in CHAT_CONTENT_FORMATS:
            raise ConfigError(
                f"--chat-template-content-format: one of {', '.join(CHAT_CONTENT_FORMATS)}, "
                f"got {self.chat_template_content_format!r}"
            )
        check_generation_setting(self.generation_config)
        parse_generation_override(self.override_generation_config)

    def kv_events(self) -> KVEventsConfig | None:
        """The validated KV-events config (None when events are off)."""
        if self.kv_events_config is None:
            return None
        cfg = KVEventsConfig.from_value(self.kv_events_config)
        return cfg if cfg.enabled else None

    def speculative(self) -> SpeculativeConfig | None:
        """The validated speculative config (None without speculative decoding)."""
        sc = self.speculative_config
        if sc is None:
            return None
        if isinstance(sc, str):
            sc = parse_speculative_json(sc)
        return SpeculativeConfig.from_dict(sc)

    def resolve(self, caps: Any = None, model_dir: str | None = None) -> ResolvedEngineConfig:
        """Resolves the policy against the model's capabilities (a ModelCapabilities, a mapping or
        an object with the same attributes; None reads them from the model folder). `model_dir`:
        the folder, when the caller has it (its generation config is read too)."""
        self.validate()
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
            mamba_cache_mode=self.mamba_cache_mode,
            enable_chunked_prefill=self.enable_chunked_prefill,
            speculative_method=None if spec is None else spec.method,
            num_speculative_tokens=0 if spec is None else spec.num_speculative_tokens,
            block_size=self.block_size,
            mamba_block_size=self.mamba_block_size,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=_core.DEFAULT_MAX_NUM_SEQS if self.max_num_seqs is None else self.max_num_seqs,
            max_model_len=self.max_model_len,
            mamba_checkpoint_placement=self.mamba_checkpoint_placement,
            prefix_cache_eviction=self.prefix_cache_eviction,
        )
        huge = 1 << 62
        if self.num_kv_blocks is not None:
            core.validate_pool_sizes(self.num_kv_blocks, huge)
        # with max_num_seqs auto, sizing lowers it to what the slots can run (config/plan.py)
        if self.num_mamba_slots is not None:
            if self.max_num_seqs is not None:
                core.validate_pool_sizes(huge, self.num_mamba_slots)
            # the engine keeps a window for every sequence that may run (config/sizing.py): a
            # pool that the engine would refuse at start is refused here already (with
            # max_num_seqs unset the engine lowers it, down to one sequence)
            seqs = int(core.max_num_seqs) if self.max_num_seqs is not None else 1
            k = int(core.num_speculative_tokens)
            need = min_mamba_slots(seqs, k, bool(core.has_mamba_layers))
            # (lowered, a sequence also takes a checkpoint slot with prefix caching: sizing's
            # state_pool_capacity, which would refuse one slot fewer after this check passed)
            checkpoint = self.max_num_seqs is None and bool(
                core.enable_prefix_caching and core.has_mamba_layers
            )
            if self.num_mamba_slots < need + checkpoint and self.max_num_seqs is None:
                raise ConfigError(
                    f"--num-mamba-slots {self.num_mamba_slots}: one running sequence with a window of "
                    f"{1 + k} slot{'s' if k else ''}{' and a checkpoint slot' if checkpoint else ''} needs "
                    f"{need + checkpoint}, counting the null slot; raise it"
                )
            if self.num_mamba_slots < need:
                runs = (self.num_mamba_slots - 1) // (1 + k)
                raise ConfigError(
                    f"--num-mamba-slots {self.num_mamba_slots}: --max-num-seqs {seqs} running sequences "
                    f"with windows of {1 + k} slot{'s' if k else ''} need {need}, counting the null slot; "
                    f"it can run {runs} (lower --max-num-seqs to {runs}, or leave it unset to have it "
                    "lowered), or raise --num-mamba-slots"
                )
        decisions = [Decision(d.code, d.level, d.message) for d in core.decisions]
        dtype = self.dtype
        if dtype == "auto":
            declared = str(caps.torch_dtype) if caps.torch_dtype else None
            dtype = declared if declared in ("float32", "bfloat16", "float16") else "float32"
            why = f"the model's torch_dtype {declared}" if declared == dtype else "default"
            decisions.append(Decision("dtype_auto", "info", f"dtype = {dtype} ({why})"))
        if spec is not None and spec.method == "ngram":
            given = self.speculative_config or {}
            if isinstance(given, str):
                given = parse_speculative_json(given)
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
        if model_dir is not None:  # (the model folder's file: read when the folder is known)
            defaults, why = sampling_defaults(
                self.generation_config, self.override_generation_config, model_dir
            )
            if defaults:
                decisions.append(Decision("generation_config_defaults", "info", why))
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
        if kwargs.get("model") is None:
            # MODEL, else --model; a parser that has neither serves the demo (one that has them and
            # got neither fails validation, naming MODEL)
            option = getattr(ns, "model_option", None)
            kwargs["model"] = option if option is not None else ("demo" if "model" not in kwargs else None)
        sc = kwargs.get("speculative_config")
        if isinstance(sc, str):
            kwargs["speculative_config"] = parse_speculative_json(sc)
        mode = kwargs.get("mamba_cache_mode")
        if mode is None:
            kwargs.pop("mamba_cache_mode", None)
        for name in (
            "block_size",
            "seed",
            "dtype",
            "mamba_ssm_cache_dtype",
            "kv_cache_dtype",
            "load_format",
            "max_queue_len",
        ):
            if kwargs.get(name, 0) is None:
                kwargs.pop(name)
        args = cls(**kwargs)
        args.validate()
        return args


# How a chat template is handed a message's content (engine/chat_template.py)
CHAT_CONTENT_FORMATS = ("auto", "string", "openai")


def chat_template_source(value: str) -> str:
    """A `--chat-template` value as vLLM reads it: the text of the file it names, else the value
    itself when it is a Jinja template. ValueError when it is neither."""
    try:
        path = Path(value).expanduser()
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except (OSError, ValueError):  # a template's text is no usable path (too long, NUL)
        pass
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"{value!r} is neither a file nor a Jinja template")


def check_chat_template(value: object) -> None:
    """`--chat-template`: a file or a template that parses; ConfigError names the flag."""
    from jinja2 import Environment, TemplateError

    if not isinstance(value, str) or not value:
        raise ConfigError(f"--chat-template must be a file or a Jinja template, got {value!r}")
    try:
        # (the extension the engine's sandbox loads, so that a template using break parses)
        Environment(extensions=["jinja2.ext.loopcontrols"]).parse(chat_template_source(value))
    except (ValueError, TemplateError) as e:
        raise ConfigError(f"--chat-template: {e}") from None


def parse_shared_prefix_markers(value: str | Sequence[int]) -> str | tuple[int, ...]:
    """The `--shared-prefix-markers` setting: "auto", "none" or token ids (a list, or a string of
    ids separated by commas). ConfigError names the flag."""
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("auto", "none"):
            return v
        parts = [p.strip() for p in v.split(",")]
        if not all(p.isascii() and p.isdigit() for p in parts):  # "²" and "٣" are digits to str
            raise ConfigError(
                f"--shared-prefix-markers must be auto, none or token ids separated by commas; got {value!r}"
            )
        return tuple(int(p) for p in parts)
    if not isinstance(value, Sequence):
        raise ConfigError(
            f"--shared-prefix-markers must be auto, none or a list of token ids; got {type(value).__name__}"
        )
    ids: tuple[object, ...] = tuple(value)
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ConfigError(f"--shared-prefix-markers: token ids must be integers >= 0; got {value!r}")
    return tuple(t for t in ids if isinstance(t, int))  # (every one is, after the check)


def check_marker_ids(markers: Sequence[int], vocab_size: int) -> None:
    """ConfigError for `--shared-prefix-markers` ids outside a tokenizer of `vocab_size` tokens
    (an id no token has would never be found: the markers would do nothing)."""
    outside = [m for m in markers if m >= vocab_size]
    if outside:
        raise ConfigError(
            f"--shared-prefix-markers: {', '.join(map(str, outside))} outside the tokenizer's {vocab_size} tokens"
        )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12}


def parse_bytes(text: str, flag: str = "memory") -> int:
    """'1073741824', '512MiB', '4GiB', '1.5GB' -> bytes (exactly: the number is read as a
    decimal, not a float, so a large byte count is not rounded)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text), flags=re.ASCII)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ConfigError(f"{flag} must be a byte count such as 1073741824, 512MiB or 4GiB; got {text!r}")
    value = math.floor(Fraction(m.group(1)) * _UNITS[unit])
    if value < 1:
        raise ConfigError(f"{flag} must be at least 1 byte; got {text!r}")
    return value
