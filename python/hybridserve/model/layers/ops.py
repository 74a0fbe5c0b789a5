"""Kernel dispatch: `torch.ops.hybridserve.<name>` (the CUDA extension) for CUDA tensors when it is
available, else the pure-torch twin in `hybridserve.kernels.reference` (same signature)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from hybridserve.kernels import reference

_cuda_loaded: bool | None = None


def _load_cuda() -> bool:
    """Import the extension loader once (`hybridserve.kernels.cuda`, owned by the CUDA side). It
    registers `torch.ops.hybridserve.*` when it can; any failure means the reference path."""
    global _cuda_loaded
    if _cuda_loaded is None:
        try:
            mod = importlib.import_module("hybridserve.kernels.cuda")
            for fn in ("load", "ensure_loaded", "load_extension"):
                f = getattr(mod, fn, None)
                if callable(f):
                    f()
                    break
            _cuda_loaded = True
        except Exception:  # noqa: BLE001 - no extension: fall back to the reference kernels
            _cuda_loaded = False
    return _cuda_loaded


def get_op(name: str, device: torch.device) -> Callable[..., Any]:
    if device.type == "cuda" and _load_cuda():
        try:
            return getattr(torch.ops.hybridserve, name)
        except (AttributeError, RuntimeError):
            pass
    return getattr(reference, name)
