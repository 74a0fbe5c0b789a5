"""The package and its extension: import, version, abi3 build, freshness of the in-tree .so."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import hybridserve
import hybridserve._core as core

ROOT = Path(__file__).resolve().parents[2]


def test_extension_is_abi3_and_fresh() -> None:
    so = Path(core.__file__)
    assert ".abi3." in so.name, so.name
    newest_source = max(p.stat().st_mtime for p in (ROOT / "rust").rglob("*.rs"))
    assert so.stat().st_mtime >= newest_source, "the extension is older than the Rust sources"


def test_the_version_has_one_source() -> None:
    import importlib.metadata
    import tomllib

    cargo = tomllib.loads((ROOT / "Cargo.toml").read_text())["package"]["version"]
    assert hybridserve.__version__ == core.__version__ == cargo
    assert importlib.metadata.version("hybridserve") == cargo  # the installed wheel's metadata
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]


def test_cli_version() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hybridserve", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"hybridserve {hybridserve.__version__}"


def test_error_hierarchy() -> None:
    assert issubclass(hybridserve.ConfigError, hybridserve.HybridServeError)
    assert issubclass(hybridserve.InvalidRequestError, hybridserve.HybridServeError)
    assert issubclass(hybridserve.HybridServeError, Exception)
