"""hybridserve: a serving engine for hybrid Mamba2/attention language models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybridserve._core import __version__  # Cargo.toml's version, the one source of it
from hybridserve.errors import ConfigError, HybridServeError, InternalError, InvalidRequestError

__all__ = [
    "LLM",
    "BeamSearchParams",
    "ConfigError",
    "EngineArgs",
    "HybridServeError",
    "InternalError",
    "InvalidRequestError",
    "SamplingParams",
    "__version__",
]

if TYPE_CHECKING:
    from hybridserve.config import EngineArgs
    from hybridserve.engine.beam_search import BeamSearchParams
    from hybridserve.engine.llm import LLM
    from hybridserve.sampling.params import SamplingParams

# Heavy modules (torch) load on first use, so `hybridserve --version` and `config` stay fast.
_LAZY = {
    "LLM": "hybridserve.engine.llm",
    "EngineArgs": "hybridserve.config",
    "SamplingParams": "hybridserve.sampling.params",
    "BeamSearchParams": "hybridserve.engine.beam_search",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'hybridserve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)
