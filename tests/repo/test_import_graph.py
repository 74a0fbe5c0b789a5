"""The package's layers only import downwards: server -> engine -> config -> {model, sampling,
spec_decode} -> kernels, with errors and the Rust module beneath everything; and the server uses
the engine through its public names only (docs/architecture.md, "Layers")."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "hybridserve"

# Higher imports lower (or its own rank); never the other way.
RANK = {
    "server": 5,
    "engine": 4,
    "config": 3,
    "model": 2,
    "sampling": 2,
    "spec_decode": 2,
    "distributed": 2,
    "kernels": 1,
    "errors": 0,
    "_core": 0,
    "arg_types": 0,
    "cache_root": 0,
}
# The command line, the benchmarks and the deployment launcher sit above every layer: nothing in a
# layer imports them.
TOOLS = {"cli", "bench", "benchmarks", "deploy", "__main__"}


def _imports(path: Path) -> Iterator[tuple[str, list[str], int]]:
    """(imported module, imported names, line) of every hybridserve import in `path`, including
    those inside functions."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "hybridserve" or node.module.startswith("hybridserve."):
                yield node.module, [a.name for a in node.names], node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("hybridserve."):
                    yield a.name, [], node.lineno


def _part(module: str, names: list[str]) -> list[str]:
    """The top-level part of the package each import reaches (`from hybridserve import x` reaches x)."""
    parts = module.split(".")
    return [parts[1]] if len(parts) > 1 else names


def upward_imports(package: Path) -> list[str]:
    bad = []
    for path in sorted(package.rglob("*.py")):
        layer = path.relative_to(package).parts[0].removesuffix(".py")  # a folder, or a module beside them
        if layer not in RANK:
            continue
        for module, names, line in _imports(path):
            for target in _part(module, names):
                if target == layer:
                    continue
                if target in TOOLS or RANK.get(target, -1) > RANK[layer]:
                    bad.append(f"{path.relative_to(package)}:{line}: {layer} imports {module} ({target})")
    return bad


def test_no_layer_imports_upwards() -> None:
    assert upward_imports(PACKAGE) == []


def test_the_server_imports_no_private_name_of_the_engine() -> None:
    bad = []
    for path in sorted((PACKAGE / "server").rglob("*.py")):
        for module, names, line in _imports(path):
            if module.startswith("hybridserve.engine"):
                private = [n for n in names if n.startswith("_")]
                if private or any(p.startswith("_") for p in module.split(".")):
                    bad.append(f"{path.name}:{line}: {module} {private}")
    assert bad == []


def test_the_check_finds_an_upward_import(tmp_path: Path) -> None:
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "ops.py").write_text("def f():\n    from hybridserve.model.layers import norm\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "ok.py").write_text("from hybridserve.kernels import ops\n")
    (tmp_path / "sampling.py").write_text("from hybridserve import engine\n")
    assert upward_imports(tmp_path) == [
        "kernels/ops.py:2: kernels imports hybridserve.model.layers (model)",
        "sampling.py:1: sampling imports hybridserve (engine)",
    ]
