"""Default sampling parameters from the model's generation config, as vLLM takes them
(`--generation-config auto|vllm|FOLDER`, `--override-generation-config JSON`).

A checkpoint's `generation_config.json` may carry its creator's recommended sampling (a reasoning
model's temperature 0.6 and top_p 0.95, say). vLLM applies those to every request that does not
set the field itself, so the same request gives the same distribution on either engine only if
hybridserve does too. The fields taken are vLLM's: temperature, top_p, top_k, min_p,
repetition_penalty, and max_new_tokens (the default max_tokens). As vLLM reads the file through
transformers' `GenerationConfig.to_diff_dict`, a value equal to transformers' own default (top_k
50, temperature 1.0, ...) is not a recommendation and is left out.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hybridserve.errors import ConfigError, InvalidRequestError
from hybridserve.sampling.params import SamplingParams

# generation_config.json name -> SamplingParams field
FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# transformers' GenerationConfig defaults: a file's value equal to one of these is no recommendation
_HF_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def _check_value(name: str, value: Any, flag: str) -> None:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or (name in ("top_k", "max_new_tokens") and not isinstance(value, int)):
        kind = "an integer" if name in ("top_k", "max_new_tokens") else "a number"
        raise ConfigError(f"{flag}: {name} must be {kind}, got {value!r}")


def parse_override(value: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """`--override-generation-config`: a JSON object (or a mapping) of generation-config fields."""
    from hybridserve.config.json_flag import parse_json_object

    flag = "--override-generation-config"
    if value is None:
        return {}
    obj = parse_json_object(value, flag) if isinstance(value, str) else value
    if not isinstance(obj, Mapping):
        raise ConfigError(f"{flag} must be a JSON object, got {value!r}")
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise ConfigError(
            f"{flag}: unknown field(s) {', '.join(map(repr, unknown))}; known: {', '.join(FIELDS)}"
        )
    for name, v in obj.items():
        _check_value(name, v, flag)
    return dict(obj)


def _read(path: Path, strict: bool) -> dict[str, Any] | None:
    """The file's object. One that is not a readable JSON object is a ConfigError when it was
    named (`strict`); the model's own is then ignored, as transformers and the loader ignore it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        if strict:
            raise ConfigError(f"--generation-config: {path} is not readable JSON ({e})") from None
        return None
    if not isinstance(data, dict):
        if strict:
            raise ConfigError(f"--generation-config: {path} does not hold a JSON object")
        return None
    return data


def check_setting(setting: object) -> None:
    """`--generation-config`: "auto", "vllm" or a folder (checked when the engine reads it)."""
    if not isinstance(setting, str) or not setting:
        raise ConfigError(f"--generation-config must be auto, vllm or a folder, got {setting!r}")


def sampling_defaults(
    setting: str, override: Mapping[str, Any] | str | None, model_dir: str | Path | None
) -> tuple[dict[str, Any], str]:
    """(SamplingParams fields and their defaults, where they came from) for an engine: `setting`
    "auto" reads the model folder's generation_config.json (its config.json without one), "vllm"
    none, anything else is a folder holding one; `override` is applied over it. ConfigError when a named folder has no
    such file, or the file is not a JSON object."""
    check_setting(setting)
    path: Path | None = None
    if setting == "auto" and model_dir is not None:
        path = Path(model_dir) / "generation_config.json"
        if not path.is_file():  # as transformers builds a generation config from config.json
            path = Path(model_dir) / "config.json"
    elif setting != "vllm":
        path = Path(setting) / "generation_config.json"
        if not path.is_file():
            raise ConfigError(f"--generation-config: {path} does not exist")
    found: dict[str, Any] = {}
    source = "none"
    data = _read(path, strict=setting != "auto") if path is not None and path.is_file() else None
    if data is not None and path is not None:
        for name in FIELDS:
            value = data.get(name)
            if value is None or value == _HF_DEFAULTS.get(name):
                continue
            _check_value(name, value, f"--generation-config ({path}; vllm leaves it out)")
            found[name] = value
        source = str(path)
    extra = parse_override(override)
    found.update(extra)
    defaults = {FIELDS[name]: value for name, value in found.items()}
    try:
        SamplingParams(**defaults)  # values no request could use stop the start, not every request
    except InvalidRequestError as e:
        raise ConfigError(
            f"--generation-config: {e} (--generation-config vllm leaves the model's file out)"
        ) from None
    if not defaults:
        return {}, f"no default sampling parameters (generation config: {source})"
    parts = ", ".join(f"{k}={v}" for k, v in sorted(defaults.items()))
    if not extra:
        return (
            defaults,
            f"default sampling parameters from {source}: {parts} (--generation-config vllm leaves them out)",
        )
    origin = (
        "--override-generation-config" if source == "none" else f"{source} and --override-generation-config"
    )
    return defaults, f"default sampling parameters from {origin}: {parts}"
