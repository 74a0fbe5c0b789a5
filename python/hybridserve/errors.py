"""Every public exception of hybridserve.

The base classes are defined in Rust (`rust/py/errors.rs`) so that an error raised by the core
arrives in Python as the same type that Python code raises; the engine's own failures derive from
them here. This module imports nothing heavy (no torch), so the server can match on these types.
"""

from hybridserve._core import ConfigError, HybridServeError, InternalError, InvalidRequestError


class StepError(HybridServeError):
    """An engine step failed; the requests in flight (`request_ids`) failed with it. The engine
    is idle and consistent again when this is raised."""

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


class EngineDeadError(HybridServeError):
    """The engine failed to load or its thread has stopped."""


__all__ = [
    "ConfigError",
    "EngineDeadError",
    "HybridServeError",
    "InternalError",
    "InvalidRequestError",
    "StepError",
]
