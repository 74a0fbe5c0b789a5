"""Where hybridserve keeps what it makes once and reuses: the demo checkpoint and the compiled CPU
and CUDA kernels, each in a folder of its own under one root."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$HYBRIDSERVE_CACHE`, else `$HYBRIDSERVE_CACHE_DIR` (another name for it), else
    `~/.cache/hybridserve`."""
    env = os.environ.get("HYBRIDSERVE_CACHE") or os.environ.get("HYBRIDSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "hybridserve"
