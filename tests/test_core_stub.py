"""`_core.pyi` stays true: every name of the Rust module is in the stub and the other way round,
and every class's public methods and properties match."""

from __future__ import annotations

import ast
from pathlib import Path

import hybridserve._core as core

STUB = Path(core.__file__).with_name("_core.pyi")


def _stub_names() -> dict[str, set[str] | None]:
    names: dict[str, set[str] | None] = {}
    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = {m.name for m in node.body if isinstance(m, ast.FunctionDef)}
        elif isinstance(node, ast.FunctionDef):
            names[node.name] = None
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = None
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            names[node.targets[0].id] = None
    return names


def test_module_names_match_the_stub() -> None:
    stub = _stub_names()
    runtime = {k for k in dir(core) if not k.startswith("__")} | {"__version__"}
    assert runtime == set(stub)


def test_class_members_match_the_stub() -> None:
    for name, members in _stub_names().items():
        if members is None:
            continue
        cls = getattr(core, name)
        if issubclass(cls, BaseException):
            assert members <= set(dir(cls))
            continue
        public = {m for m in dir(cls) if not m.startswith("_")}
        declared = {m for m in members if not m.startswith("_")}
        assert public == declared, name
