"""`--speculative-config`: the validated `SpeculativeConfig` and its JSON form."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from hybridserve import _core
from hybridserve.config.json_flag import parse_json_object
from hybridserve.errors import ConfigError

if TYPE_CHECKING:
    from hybridserve._core import SpeculativeMethodName

DEFAULT_PROMPT_LOOKUP_MIN = 1
DEFAULT_PROMPT_LOOKUP_MAX = 4
MAX_PROMPT_LOOKUP = 64


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# `model` values that vLLM reads as n-gram speculation
_NGRAM_MODEL_NAMES = ("ngram", "[ngram]")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config` after validation."""

    method: SpeculativeMethodName  # one of _core.SPECULATIVE_METHODS
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
        methods = _core.SPECULATIVE_METHODS
        d = dict(d)
        if d.get("model") in _NGRAM_MODEL_NAMES and d.get("method") in (None, "ngram"):
            # vLLM's older spelling of n-gram speculation: the method given as the model
            d["method"], d["model"] = "ngram", None
        elif d.get("method") is None and isinstance(d.get("model"), str) and d["model"]:
            d["method"] = "draft_model"  # as vLLM: a model and no method is a draft model
        if d.get("method") is None:
            raise ConfigError(
                f"{flag}: 'method' is required (one of {', '.join(methods)}) unless 'model' names a draft model"
            )
        if d["method"] not in methods:
            raise ConfigError(f"{flag}: 'method' must be one of {', '.join(methods)}, got {d['method']!r}")
        method = cast("SpeculativeMethodName", d["method"])
        if "num_speculative_tokens" not in d:
            raise ConfigError(f"{flag}: 'num_speculative_tokens' is required")
        k = d["num_speculative_tokens"]
        limit = _core.MAX_SPECULATIVE_TOKENS
        if not _is_int(k) or not 1 <= k <= limit:
            raise ConfigError(f"{flag}: 'num_speculative_tokens' must be an integer in 1..{limit}, got {k!r}")
        model = d.get("model")
        lo = d.get("prompt_lookup_min")
        hi = d.get("prompt_lookup_max")
        if method == "draft_model":
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
        # one bound given: the other defaults, moved so that min <= max
        lo_n: int = DEFAULT_PROMPT_LOOKUP_MIN if lo is None else int(lo)
        hi_n: int = DEFAULT_PROMPT_LOOKUP_MAX if hi is None else int(hi)
        if lo is None:
            lo_n = min(lo_n, hi_n)
        elif hi is None:
            hi_n = max(hi_n, lo_n)
        if lo_n > hi_n:
            raise ConfigError(f"{flag}: 'prompt_lookup_min' ({lo_n}) must be <= 'prompt_lookup_max' ({hi_n})")
        return cls(method, int(k), prompt_lookup_min=lo_n, prompt_lookup_max=hi_n)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
        }
        if self.model is not None:
            out["model"] = self.model
        if self.prompt_lookup_min is not None:
            out["prompt_lookup_min"] = self.prompt_lookup_min
            out["prompt_lookup_max"] = self.prompt_lookup_max
        return out


def parse_speculative_json(text: str) -> dict[str, Any]:
    return parse_json_object(text, "--speculative-config")
