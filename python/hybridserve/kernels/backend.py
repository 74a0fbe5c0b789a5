"""Which implementation of the kernels runs: chosen once, when the model runner starts.

- ``cpu-native``: the C++ CPU kernels of ``kernels/native.py`` (decode attention, the Mamba
  recurrence, RMSNorms), built on first use; the pure-torch twins run the ops they do not cover.
- ``cuda``: the CUDA extension of ``kernels/cuda.py`` (``torch.ops.hybridserve.*``).
- ``reference``: the pure-torch twins of ``kernels/reference.py`` only (the oracle of the tests).

``resolve(device)`` picks one for a device and builds it (so its cost is paid at start, not in
the first step); ``pin`` makes it the one every call uses. ``HYBRIDSERVE_KERNELS`` chooses by
hand: ``auto`` (default: the fast implementation of the device when it builds, else the twins),
``reference``, ``native`` (error if the C++ kernels do not build), ``cuda`` (error if the
extension does not build). ``HYBRIDSERVE_NATIVE_CPU=0`` is ``reference`` on the CPU.

Within the pinned backend one choice stays per call, because it depends on the tensors: an op the
backend does not support for a dtype or shape (e.g. float64 on CUDA) runs its twin. Code that
calls the kernels without a runner (kernel tests, benchmarks) gets the device's backend resolved
on first use.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("hybridserve.kernels")

__all__ = ["Backend", "active", "describe", "pin", "pinned", "requested", "resolve", "use"]


class Backend(StrEnum):
    CPU_NATIVE = "cpu-native"
    CUDA = "cuda"
    REFERENCE = "reference"


_REQUESTS = ("auto", "reference", "native", "cuda")
_lock = threading.Lock()
_pinned: Backend | None = None
_resolved: dict[str, Backend] = {}  # by device type, when nothing is pinned


def requested() -> str:
    """``HYBRIDSERVE_KERNELS``: auto, reference, native or cuda."""
    mode = os.environ.get("HYBRIDSERVE_KERNELS", "auto").strip().lower() or "auto"
    if mode not in _REQUESTS:
        raise ValueError(f"HYBRIDSERVE_KERNELS must be one of {', '.join(_REQUESTS)}, got {mode!r}")
    return mode


def resolve(device: torch.device | str) -> Backend:
    """The backend for a model on `device`, built now; RuntimeError when the one asked for by
    ``HYBRIDSERVE_KERNELS`` cannot run there."""
    device_type = device if isinstance(device, str) else device.type
    device_type = device_type.split(":")[0]
    mode = requested()
    if mode == "reference":
        return Backend.REFERENCE
    if device_type == "cuda":
        if mode == "native":
            raise RuntimeError(
                "HYBRIDSERVE_KERNELS=native: the C++ kernels run on the CPU, the model is on CUDA"
            )
        from hybridserve.kernels import cuda

        try:
            cuda.load_extension()
        except RuntimeError as e:
            if mode == "cuda":
                raise
            logger.warning("CUDA kernels unavailable, using the pure-torch kernels: %s", e)
            return Backend.REFERENCE
        return Backend.CUDA
    if mode == "cuda":
        raise RuntimeError(f"HYBRIDSERVE_KERNELS=cuda: the model is on {device_type}, not on a CUDA device")
    from hybridserve.kernels import native

    if not native.enabled():
        return Backend.REFERENCE
    if native.build() is None:
        if mode == "native":
            raise RuntimeError(
                "HYBRIDSERVE_KERNELS=native: the C++ CPU kernels could not be built (see the log)"
            )
        return Backend.REFERENCE
    return Backend.CPU_NATIVE


def pin(backend: Backend | None) -> None:
    """Every kernel call from now on uses `backend` (None: resolve per device type again)."""
    global _pinned
    with _lock:
        _pinned = backend
        _resolved.clear()


@contextlib.contextmanager
def use(backend: Backend | None) -> Iterator[None]:
    """`pin(backend)` for the duration of a with-block, then the previous choice again."""
    before = _pinned
    pin(backend)
    try:
        yield
    finally:
        pin(before)


def pinned() -> Backend | None:
    return _pinned


def active(device_type: str) -> Backend:
    """The backend a call on tensors of `device_type` uses: the pinned one, else the device's."""
    if _pinned is not None:
        return _pinned
    found = _resolved.get(device_type)
    if found is None:
        with _lock:
            found = _resolved.get(device_type)
            if found is None:
                try:
                    found = resolve(device_type)
                except RuntimeError:
                    found = Backend.REFERENCE if requested() != "cuda" else Backend.CUDA
                _resolved[device_type] = found
    return found


def describe(backend: Backend) -> str:
    """One line for the log: what runs."""
    return {
        Backend.CPU_NATIVE: "C++ CPU kernels (decode attention, Mamba recurrence, RMSNorms); pure-torch ops elsewhere",
        Backend.CUDA: "CUDA kernels (SSD scan, state update, conv1d, slot copy, rejection sampling)",
        Backend.REFERENCE: "pure-torch reference kernels",
    }[backend]
