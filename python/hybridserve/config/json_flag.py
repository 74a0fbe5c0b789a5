"""Flags whose value is a JSON object (`--speculative-config`, `--kv-events-config`)."""

from __future__ import annotations

import json
from typing import Any

from hybridserve.errors import ConfigError


def parse_json_object(text: str, flag: str) -> dict[str, Any]:
    """The JSON object `text`; ConfigError naming `flag` when it is not JSON or not an object."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{flag} must be a JSON object: {e}") from None
    except RecursionError:
        raise ConfigError(f"{flag} must be a JSON object: it is nested too deeply") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object, got {text!r}")
    return value
