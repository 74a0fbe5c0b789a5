"""Architectures: one module per model family, registered by its HF `architectures` name.

A new architecture is one file here: a `CausalLM` subclass decorated with `@register("XForCausalLM")`
that implements `parse_config(raw, source) -> ModelConfig` and builds its modules under the
checkpoint's state-dict names; then add its module name to `_MODULES` below. A family shaped as
embeddings -> decoder layers -> final norm -> LM head (all of them so far) subclasses
`base.StackedCausalLM`, and its parser reads the fields other families spell alike with
`shared_fields`.
"""

from __future__ import annotations

import importlib

from hybridserve.errors import ConfigError
from hybridserve.model.architectures.base import CausalLM, register, registered

_MODULES = ("nemotron_h", "bamba", "mamba2", "granitemoehybrid", "falcon_h1", "zamba2", "jamba")
_loaded = False


def _load_all() -> None:
    global _loaded
    if not _loaded:
        for m in _MODULES:
            importlib.import_module(f"{__name__}.{m}")
        _loaded = True


def get_architecture(name: str, source: str = "config.json") -> type[CausalLM]:
    """The registered class for an HF architecture name; ConfigError naming `source` otherwise."""
    _load_all()
    cls = registered().get(name)
    if cls is None:
        raise ConfigError(
            f"{source}: unsupported architecture {name!r}; supported: {', '.join(sorted(registered()))}"
        )
    return cls


def supported_architectures() -> list[str]:
    _load_all()
    return sorted(registered())


__all__ = ["CausalLM", "get_architecture", "register", "supported_architectures"]
