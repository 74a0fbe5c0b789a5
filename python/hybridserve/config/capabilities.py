"""What the cache-mode policy knows about a model: `ModelCapabilities`, read from its config.json
by the model package's one reader (`model/model_config.py`), and the demo model's folder."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridserve.errors import ConfigError
from hybridserve.model.model_config import MAX_CONFIG_COUNT, model_capabilities, read_config_json


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
            if not _is_count(v) or not lo <= v <= MAX_CONFIG_COUNT:
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


def _is_count(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def read_model_capabilities(model_dir: str | Path) -> ModelCapabilities:
    """Capabilities from `model_dir/config.json` (HF format); see `model_capabilities`. An optional
    `"hybridserve": {...}` object in config.json overrides any field (e.g.
    `{"supports_boundary_states": false}`)."""
    path = Path(model_dir) / "config.json"
    raw = read_config_json(path)
    values = model_capabilities(raw, str(path))
    overrides = raw.get("hybridserve")
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
