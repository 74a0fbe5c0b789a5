"""The one reader of a model's config.json (Hugging Face format), without torch.

- `read_config_json`: the file as a dict (tagged floats decoded), errors naming the file;
- `layer_kinds` and `scan_chunk_size`: the layer layout and the Mamba scan chunk, for every model
  type (what the cache-mode policy needs, through `model_capabilities`, and what the architecture
  parsers build on, so the two can never disagree);
- `ModelConfig`: the full, architecture-independent view each architecture module
  (`architectures/*.py`) parses; the layers and the cache allocator read only this.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridserve.errors import ConfigError

logger = logging.getLogger("hybridserve.model")

# Our layer kinds. Bamba/Mamba2-style layers carry their FFN inside the same layer; NemotronH has
# separate "mlp" / "moe" layers; a "hybrid" layer has both a KV cache and a Mamba state (it counts as
# a Mamba and an attention layer): Falcon-H1's runs a Mamba2 mixer and attention side by side,
# Zamba2's one use of a shared attention block followed by a Mamba2 layer.
MAMBA = "mamba"
ATTENTION = "attention"
MLP = "mlp"
MOE = "moe"
HYBRID = "hybrid"
LAYER_KINDS = (MAMBA, ATTENTION, MLP, MOE, HYBRID)

# transformers 5.x names and the legacy 4.x ones, to our kinds.
_LAYER_NAME_MAP = {
    "linear_attention": MAMBA,
    "mamba": MAMBA,
    "full_attention": ATTENTION,
    "attention": ATTENTION,
    "mlp": MLP,
    "moe": MOE,
}


def decode_tagged_floats(obj: Any) -> Any:
    """Undo transformers' float tagging: ``{"__float__": "Infinity"}`` -> ``math.inf`` (also
    "-Infinity" and "NaN"), recursively."""
    if isinstance(obj, dict):
        if set(obj.keys()) == {"__float__"}:
            v = obj["__float__"]
            try:
                return float(v)
            except (TypeError, ValueError):
                raise ConfigError(f"bad tagged float {obj!r}") from None
        return {k: decode_tagged_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_tagged_floats(v) for v in obj]
    return obj


def read_config_json(path: str | Path) -> dict[str, Any]:
    """config.json as a dict with tagged floats decoded. ConfigError naming the file on failure."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{p}: no config.json in the model folder") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: invalid JSON: {e}") from None
    except RecursionError:
        raise ConfigError(f"{p}: invalid JSON: nested too deeply") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a JSON object")
    return decode_tagged_floats(raw)


# Model types whose layers include Mamba2 mixers, with the scan chunk size each uses when its
# config.json declares none (the defaults of their transformers configs).
SCAN_CHUNK_DEFAULTS = {
    "nemotron_h": 128,
    "bamba": 256,
    "mamba2": 256,
    "granitemoehybrid": 256,
    "falcon_h1": 256,
    "zamba2": 256,
    # Mamba1's scan is a plain recurrence: the state after every token is at hand, any token ends
    # a "chunk"
    "jamba": 1,
}
# The model_type of every architecture the engine runs, as transformers pairs them. A config.json
# names both: the cache policy reads the family from model_type, the loader builds the class that
# architectures names, so the two must agree (with model_type "llama" over NemotronH weights the
# policy saw no Mamba layers and kept no states for the ones that ran).
ARCHITECTURE_MODEL_TYPES = {
    "NemotronHForCausalLM": "nemotron_h",
    "BambaForCausalLM": "bamba",
    "Mamba2ForCausalLM": "mamba2",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
    "FalconH1ForCausalLM": "falcon_h1",
    "Zamba2ForCausalLM": "zamba2",
    "JambaForCausalLM": "jamba",
}
# NemotronH's hybrid_override_pattern: one character per layer.
NEMOTRON_H_PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
# Far above any real model's context or chunk size, and far below what the core's 64-bit
# integers overflow at.
MAX_CONFIG_COUNT = 1 << 40


def layer_kinds_from_names(names: list[Any], source: str) -> list[str]:
    out = []
    for n in names:
        kind = _LAYER_NAME_MAP.get(str(n))
        if kind is None:
            raise ConfigError(f"{source}: unknown layer type {n!r} (known: {sorted(_LAYER_NAME_MAP)})")
        out.append(kind)
    return out


# The MLP activations the layers build (layers/mlp.py `activation`), by transformers' names
MLP_ACTIVATIONS = ("relu2", "silu", "swish", "relu", "gelu", "gelu_pytorch_tanh", "gelu_new")


@dataclass
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: list[str]  # one of LAYER_KINDS per layer
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    residual_in_fp32: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    max_position_embeddings: int = 4096
    # --- Mamba mixer (Mamba2; Mamba1 when mamba_version is 1: a state per channel, held as
    # nheads = d_inner heads of headdim 1, and a conv over the d_inner channels only) ---
    mamba_version: int = 2
    nheads: int = 0
    headdim: int = 0
    dstate: int = 0
    ngroups: int = 1
    d_conv: int = 4
    chunk_size: int = 256
    d_inner: int = 0
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_act: str = "silu"
    mamba_norm_eps: float = 1e-5
    dt_min: float = 0.0  # dt clamp after softplus, applied identically in prefill and decode
    dt_max: float = math.inf
    mamba_ssm_cache_dtype: str = "float32"
    # --- attention ---
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    attention_bias: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.0  # 0 = no rotary embedding (NemotronH)
    # --- MLP ---
    intermediate_size: int = 0
    mlp_act: str = "relu2"
    mlp_bias: bool = False
    mlp_gated: bool = False  # gate_proj * up_proj (Bamba) vs up_proj only (NemotronH)
    # --- MoE (NemotronH) ---
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    moe_latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    # ---- derived ----
    @property
    def conv_dim(self) -> int:
        if self.mamba_version == 1:
            return self.d_inner
        return self.d_inner + 2 * self.ngroups * self.dstate

    @property
    def has_mamba_layers(self) -> bool:
        return MAMBA in self.layer_types or HYBRID in self.layer_types

    @property
    def supports_boundary_states(self) -> bool:
        """The prefill scan can emit the state after any token of a row (the checkpoints of the
        `all` cache mode, at block boundaries)."""
        return True

    @property
    def mamba_layer_ids(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_types) if k in (MAMBA, HYBRID)]

    @property
    def attention_layer_ids(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_types) if k in (ATTENTION, HYBRID)]

    @property
    def num_mamba_layers(self) -> int:
        return len(self.mamba_layer_ids)

    @property
    def num_attention_layers(self) -> int:
        return len(self.attention_layer_ids)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def capabilities(self) -> dict[str, Any]:
        """What the cache-mode policy needs (a mapping `hybridserve.config.ModelCapabilities.coerce`
        accepts)."""
        return {
            "model_type": self.model_type,
            "has_mamba_layers": self.has_mamba_layers,
            "supports_boundary_states": self.has_mamba_layers and self.supports_boundary_states,
            "scan_chunk_size": self.chunk_size if self.has_mamba_layers else None,
            "max_position_embeddings": self.max_position_embeddings,
            "num_mamba_layers": self.num_mamba_layers,
            "num_attention_layers": self.num_attention_layers,
            "torch_dtype": self.raw.get("dtype") or self.raw.get("torch_dtype"),
        }

    def validate(self, source: str) -> None:
        """Consistency checks; ConfigError naming `source` (the config.json path)."""

        def bad(msg: str) -> ConfigError:
            return ConfigError(f"{source}: {msg}")

        if self.vocab_size <= 0 or self.hidden_size <= 0:
            raise bad("vocab_size and hidden_size must be positive")
        for what, eps in (("norm epsilon", self.norm_eps), ("Mamba norm epsilon", self.mamba_norm_eps)):
            if not (math.isfinite(eps) and eps >= 0):  # (NaN logits on every request otherwise)
                raise bad(f"the {what} must be a finite number >= 0, got {eps!r}")
        if self.mlp_act not in MLP_ACTIVATIONS:
            raise bad(
                f"unsupported MLP activation {self.mlp_act!r} (hidden_act / mlp_hidden_act); "
                f"supported: {', '.join(MLP_ACTIVATIONS)}"
            )
        if len(self.layer_types) != self.num_layers or self.num_layers <= 0:
            raise bad(f"layer pattern has {len(self.layer_types)} entries for {self.num_layers} layers")
        for k in self.layer_types:
            if k not in LAYER_KINDS:
                raise bad(f"unknown layer kind {k!r}")
        if self.has_mamba_layers:
            if min(self.nheads, self.headdim, self.dstate, self.ngroups, self.d_conv, self.chunk_size) <= 0:
                raise bad("mamba dimensions must be positive")
            if self.nheads % self.ngroups != 0:
                raise bad(f"mamba heads ({self.nheads}) must be divisible by n_groups ({self.ngroups})")
            if self.d_inner != self.nheads * self.headdim:
                raise bad(
                    f"mamba intermediate size {self.d_inner} != heads x head_dim = {self.nheads * self.headdim}"
                )
            if self.d_inner % self.ngroups != 0:
                raise bad("mamba intermediate size must be divisible by n_groups")
            if self.mamba_act not in ("silu", "swish"):
                raise bad(f"unsupported mamba activation {self.mamba_act!r}")
            if not (0.0 <= self.dt_min <= self.dt_max):
                raise bad(f"bad time step limit ({self.dt_min}, {self.dt_max})")
        if ATTENTION in self.layer_types or HYBRID in self.layer_types:
            if min(self.num_heads, self.num_kv_heads, self.head_dim) <= 0:
                raise bad("attention dimensions must be positive")
            if self.num_heads % self.num_kv_heads != 0:
                raise bad(f"num_attention_heads {self.num_heads} not divisible by num_key_value_heads")
            if self.rotary_dim % 2 != 0:
                raise bad(f"rotary dimension {self.rotary_dim} must be even")
        if MOE in self.layer_types:
            if self.n_routed_experts <= 0 or not (0 < self.num_experts_per_tok <= self.n_routed_experts):
                raise bad("bad MoE expert counts")
            if self.n_routed_experts % self.n_group != 0 or not (0 < self.topk_group <= self.n_group):
                raise bad("bad MoE group counts (n_group / topk_group)")

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        d = asdict(self)
        d.pop("raw", None)
        d["conv_dim"] = self.conv_dim
        d["has_mamba_layers"] = self.has_mamba_layers
        return d


def get_field(raw: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The first of `names` present (and not None) in `raw`, else `default`."""
    for n in names:
        if n in raw and raw[n] is not None:
            return raw[n]
    return default


def integral(v: Any, name: str) -> int:
    """`v` as an int: an integer, or a float with no fraction (128.0); anything else (128.7, a
    bool, a string) is a TypeError naming the field, which the config parser reports with the
    file's name, instead of a silently truncated size."""
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or (isinstance(v, float) and not v.is_integer())
    ):
        raise TypeError(f"{name} must be an integer, got {v!r}")
    return int(v)


_REQUIRED = object()


def get_int(raw: dict[str, Any], *names: str, default: Any = _REQUIRED) -> int:
    """The first of `names` present (and not None) as an int (see `integral`); `default` when
    none is, KeyError when there is no default."""
    for n in names:
        if raw.get(n) is not None:
            return integral(raw[n], n)
    if default is _REQUIRED:
        raise KeyError(names[0])
    return integral(default, names[0])


def get_float(raw: dict[str, Any], *names: str, default: Any) -> float:
    """The first of `names` present (and not None) as a float, else `default`: a number (an int
    or a float); a bool or a string is a TypeError naming the field."""
    v = get_field(raw, *names, default=default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{names[0]} must be a number, got {v!r}")
    return float(v)


def get_flag(raw: dict[str, Any], *names: str, default: bool) -> bool:
    """A true/false field (the first of `names` present): a string such as "false" is an error,
    not truthy. TypeError, which the config parser reports with the file's name."""
    v = get_field(raw, *names, default=default)
    if not isinstance(v, bool):
        raise TypeError(f"{names[0]} must be true or false, got {v!r}")
    return v


def token_ids(raw: dict[str, Any], name: str) -> tuple[int | None, list[int]]:
    """(the first id, every id) of a token-id field, which may list several. A negative id names
    no token (LLaMA's configs write `pad_token_id: -1` for none) and is left out: kept, every
    request would be refused for its out-of-range EOS."""
    v = raw.get(name)
    if v is None:
        return None, []
    ids = [integral(x, name) for x in (v if isinstance(v, list) else [v])]
    ids = [i for i in ids if i >= 0]
    return (ids[0] if ids else None), ids


def time_step_limit(raw: dict[str, Any], *names: str) -> tuple[float, float]:
    v = decode_tagged_floats(get_field(raw, *names))
    if v is None:
        return 0.0, math.inf
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise ConfigError(f"time_step_limit must be a pair, got {v!r}")
    try:
        return float(v[0]), float(v[1])
    except (TypeError, ValueError):
        raise ConfigError(f"time_step_limit must be two numbers, got {v!r}") from None


def config_count(raw: dict[str, Any], source: str, *names: str) -> int | None:
    """The first of `names` present as a positive integer (a whole float, 4.0, too, as every size
    is read), None when all are absent or null; anything else is an error naming the file and
    the field it found (not a silent default)."""
    name = next((n for n in names if raw.get(n) is not None), None)
    if name is None:
        return None
    v = raw[name]
    if isinstance(v, float) and v.is_integer() and 1 <= v <= MAX_CONFIG_COUNT:
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_CONFIG_COUNT:
        raise ConfigError(f"{source}: {name} must be a positive integer, got {v!r}")
    return v


def first_architecture(raw: dict[str, Any]) -> str | None:
    """config.json's `architectures[0]`, or None when it names none."""
    archs = raw.get("architectures")
    return str(archs[0]) if isinstance(archs, list) and archs else None


def model_type_of(raw: dict[str, Any], source: str = "config.json") -> str:
    """The model family: `model_type`, or the one `architectures[0]` implies when it has none
    ("unknown" without either). ConfigError when the two name different families the engine
    knows."""
    arch = first_architecture(raw)
    implied = ARCHITECTURE_MODEL_TYPES.get(arch or "")
    declared = raw.get("model_type")
    if not declared:
        return implied or "unknown"
    model_type = str(declared).lower()
    if implied is not None and model_type != implied:
        raise ConfigError(
            f"{source}: model_type {declared!r} is not the model type of architectures[0] {arch!r} "
            f"({implied!r})"
        )
    return model_type


# transformers' Zamba2Config default `layers_block_type` ("hybrid": a shared attention block's use
# followed by a Mamba2 layer).
ZAMBA2_DEFAULT_LAYERS = (
    ["mamba"] + (["mamba"] * 5 + ["hybrid"]) * 7 + ["mamba"] * 4 + ["hybrid"] + ["mamba"] * 3
    + ["hybrid"] + ["mamba"] * 2
)  # fmt: skip


def _zamba2_kinds(names: list[Any], source: str) -> list[str]:
    """Zamba2's `layers_block_type`: "mamba" (or transformers 5's "linear_attention") and "hybrid"."""
    kinds = {"mamba": MAMBA, "linear_attention": MAMBA, "hybrid": HYBRID}
    out = []
    for n in names:
        kind = kinds.get(str(n))
        if kind is None:
            raise ConfigError(
                f"{source}: layers_block_type: unsupported Zamba2 layer type {n!r} (known: {sorted(kinds)})"
            )
        out.append(kind)
    return out


def layer_kinds(raw: dict[str, Any], source: str, model_type: str | None = None) -> list[str]:
    """One of LAYER_KINDS per layer, as config.json declares them: `layers_block_type` /
    `layer_types`, NemotronH's `hybrid_override_pattern`, Bamba's `attn_layer_indices`, Mamba2's
    all-Mamba stack, Falcon-H1's all-hybrid one, Zamba2's Mamba and hybrid layers (transformers'
    default layout when its config.json has none), Jamba's attention every `attn_layer_period`-th
    layer from `attn_layer_offset`; a model type without Mamba layers is taken as
    attention layers.
    `model_type`: the architecture's own, for a config.json that does not name it."""
    model_type = model_type or model_type_of(raw, source)
    names = get_field(raw, "layers_block_type", "layer_types")
    if names is not None:
        listed_by = "layers_block_type" if raw.get("layers_block_type") is not None else "layer_types"
        if not isinstance(names, list):
            raise ConfigError(f"{source}: {listed_by} must be a list")
        if model_type == "zamba2":
            return _listed_layers(raw, source, _zamba2_kinds(names, source), listed_by)
        kinds = layer_kinds_from_names(names, source)
        if model_type == "nemotron_h":  # (its count is the list's length in transformers)
            return _counted_by_list(raw, source, kinds, listed_by)
        return _listed_layers(raw, source, kinds, listed_by)
    if model_type == "nemotron_h":
        pattern = raw.get("hybrid_override_pattern")
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(
                f"{source}: NemotronH config needs layers_block_type or hybrid_override_pattern"
            )
        bad = sorted(set(pattern) - set(NEMOTRON_H_PATTERN))
        if bad:
            raise ConfigError(f"{source}: hybrid_override_pattern has unknown layer codes {bad}")
        kinds = [NEMOTRON_H_PATTERN[c] for c in pattern]
        return _counted_by_list(raw, source, kinds, "hybrid_override_pattern")
    n = config_count(raw, source, "num_hidden_layers", "n_layer") or 0
    if model_type == "bamba":
        try:
            attn = {integral(i, "attn_layer_indices") for i in (raw.get("attn_layer_indices") or [])}
        except TypeError as e:
            raise ConfigError(f"{source}: {e}") from None
        return [ATTENTION if i in attn else MAMBA for i in range(n)]
    if model_type == "falcon_h1":
        return [HYBRID] * n
    if model_type == "zamba2":  # transformers' default layout (Zamba2-2.7B's 54 layers)
        return _zamba2_kinds(ZAMBA2_DEFAULT_LAYERS, source)
    if model_type == "jamba":
        return [ATTENTION if on_period(raw, source, "attn_layer", i, (8, 4)) else MAMBA for i in range(n)]
    if model_type in SCAN_CHUNK_DEFAULTS:
        return [MAMBA] * n
    return [ATTENTION] * n


def _counted_by_list(raw: dict[str, Any], source: str, kinds: list[str], listed_by: str) -> list[str]:
    """NemotronH's layers, which its list or pattern counts: transformers' NemotronHConfig takes
    their number from it (its `num_hidden_layers` is the list's length) and vLLM builds its
    layers, so a checkpoint with a stale count loads there; a disagreeing count is said (the
    layers left unread are warned of as unused tensors)."""
    n = config_count(raw, source, "num_hidden_layers")
    if n is not None and n != len(kinds):
        logger.warning(
            "%s: num_hidden_layers is %d but %s lists %d layers: the list's are built",
            source, n, listed_by, len(kinds),
        )  # fmt: skip
    return kinds


def _listed_layers(raw: dict[str, Any], source: str, kinds: list[str], listed_by: str) -> list[str]:
    """Layers a list (or pattern) declares, which a `num_hidden_layers` beside it must count: a
    stack built from one of two disagreeing sizes leaves a checkpoint's layers unread, or
    missing."""
    name = "num_hidden_layers" if raw.get("num_hidden_layers") is not None else "n_layer"
    n = config_count(raw, source, name)
    if n is not None and n != len(kinds):
        raise ConfigError(f"{source}: {name} is {n} but {listed_by} lists {len(kinds)} layers")
    return kinds


def on_period(raw: dict[str, Any], source: str, prefix: str, i: int, default: tuple[int, int]) -> bool:
    """Whether layer `i` is one of Jamba's every-`{prefix}_period`-th layers from
    `{prefix}_offset` (attention layers, MoE layers)."""
    period = config_count(raw, source, f"{prefix}_period") or default[0]
    offset = get_field(raw, f"{prefix}_offset", default=default[1])
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < period:
        raise ConfigError(
            f"{source}: {prefix}_offset must be an integer in [0, {prefix}_period), got {offset!r}"
        )
    return i % period == offset


def scan_chunk_size(raw: dict[str, Any], source: str, model_type: str | None = None) -> int | None:
    """Q, the Mamba scan's chunk size: `chunk_size` or `mamba_chunk_size`, else the model type's
    default; None for a model type without Mamba layers."""
    kind = model_type or model_type_of(raw, source)
    default = SCAN_CHUNK_DEFAULTS.get(kind)
    if default is None:
        return None
    # (transformers' NemotronHConfig lets the legacy `mamba_chunk_size` win over `chunk_size`)
    names = ("chunk_size", "mamba_chunk_size")
    q = config_count(raw, source, *(reversed(names) if kind == "nemotron_h" else names))
    return default if q is None else q


def model_capabilities(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """What the cache-mode policy needs to know about a model (the fields of
    `hybridserve.config.ModelCapabilities`), from its config.json alone: no weights, no full parse,
    so `hybridserve config` explains a model type the engine cannot run yet too."""
    model_type = model_type_of(raw, source)
    kinds = layer_kinds(raw, source, model_type)
    n_hybrid = kinds.count(HYBRID)  # a Falcon-H1 layer: attention and Mamba side by side
    n_mamba, n_attn = kinds.count(MAMBA) + n_hybrid, kinds.count(ATTENTION) + n_hybrid
    has_mamba = model_type in SCAN_CHUNK_DEFAULTS and n_mamba > 0
    return {
        "model_type": model_type,
        "has_mamba_layers": has_mamba,
        "supports_boundary_states": has_mamba,
        "scan_chunk_size": scan_chunk_size(raw, source) if has_mamba else None,
        "max_position_embeddings": config_count(raw, source, "max_position_embeddings"),
        "num_mamba_layers": n_mamba if has_mamba else 0,
        "num_attention_layers": n_attn,
        "torch_dtype": raw.get("torch_dtype") or raw.get("dtype"),
    }
