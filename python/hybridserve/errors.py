"""The exception hierarchy. The classes are defined in Rust (`rust/py/errors.rs`) so that an error
raised by the core arrives in Python as the same type that Python code raises."""

from hybridserve._core import ConfigError, HybridServeError, InternalError, InvalidRequestError

__all__ = ["ConfigError", "HybridServeError", "InternalError", "InvalidRequestError"]
