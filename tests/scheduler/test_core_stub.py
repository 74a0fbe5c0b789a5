"""`_core.pyi` stays true: every name of the Rust module is in the stub and the other way round,
and every class's public methods and properties match."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

import hybridserve._core as core
from hybridserve.errors import InvalidRequestError

STUB = Path(core.__file__).with_name("_core.pyi")


def _stub_names() -> dict[str, set[str] | None]:
    names: dict[str, set[str] | None] = {}
    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = {m.name for m in node.body if isinstance(m, ast.FunctionDef)}
        elif isinstance(node, ast.FunctionDef):
            names[node.name] = None
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(node.annotation, ast.Name) and node.annotation.id == "TypeAlias":
                continue  # a type of the stub only (the Literal of an enum's names)
            names[node.target.id] = None
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            names[node.targets[0].id] = None
    return names


def test_module_names_match_the_stub() -> None:
    stub = {k for k in _stub_names() if not k.startswith("_") or k == "__version__"}  # not aliases
    runtime = {k for k in dir(core) if not k.startswith("__")} | {"__version__"}
    assert runtime == stub


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


def test_classes_without_a_stub_constructor_cannot_be_made_and_none_is_a_base() -> None:
    import pickle

    import pytest

    tree = ast.parse(STUB.read_text())
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        cls = getattr(core, node.name)
        if issubclass(cls, BaseException):
            # exceptions live where the stub says, so that they pickle (for worker processes)
            assert cls.__module__ == "hybridserve._core"
            assert type(pickle.loads(pickle.dumps(cls("x")))) is cls
            continue
        assert any(isinstance(d, ast.Name) and d.id == "final" for d in node.decorator_list), node.name
        with pytest.raises(TypeError):
            type("Sub", (cls,), {})
        if not any(isinstance(m, ast.FunctionDef) and m.name in ("__init__", "__new__") for m in node.body):
            with pytest.raises(TypeError):
                cls()


def test_scheduler_hash_seed_may_be_none() -> None:
    cfg = core.ResolvedConfig.for_tests()
    a = core.Scheduler(cfg, 256, 64, None)
    b = core.Scheduler(cfg, 256, 64)
    assert a.num_running == b.num_running == 0


def _stub_literal(alias: str) -> tuple[str, ...]:
    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == alias:
            assert isinstance(node.value, ast.Subscript)
            elts = node.value.slice.elts if isinstance(node.value.slice, ast.Tuple) else [node.value.slice]
            return tuple(ast.literal_eval(e) for e in elts)
    raise AssertionError(f"{alias} is not in the stub")


def test_the_stubs_literals_are_the_rust_enums_names() -> None:
    assert _stub_literal("MambaCacheModeName") == core.MAMBA_CACHE_MODES
    assert _stub_literal("CheckpointPlacementName") == core.CHECKPOINT_PLACEMENTS
    assert _stub_literal("EvictionPolicyName") == core.EVICTION_POLICIES
    assert _stub_literal("SpeculativeMethodName") == core.SPECULATIVE_METHODS
    assert _stub_literal("ResolvedMambaCacheMode") == tuple(m for m in core.MAMBA_CACHE_MODES if m != "auto")
    for mode in _stub_literal("ResolvedMambaCacheMode"):  # each is a mode the core resolves to
        assert core.ResolvedConfig.for_tests(mode).mamba_cache_mode == mode


def test_flag_limits_are_what_the_policy_enforces() -> None:
    import pytest

    limits = core.FLAG_LIMITS
    assert limits["block_size"] == (1, core.MAX_BLOCK_SIZE)
    caps = {"has_mamba_layers": True, "supports_boundary_states": True, "scan_chunk_size": 8}
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "mamba_block_size"):
        lo, hi = limits[name]
        for bad in (lo - 1, hi + 1):
            with pytest.raises(core.ConfigError, match="--" + name.replace("_", "-")):
                core.resolve_policy(**caps, **{name: bad})


def test_set_cost_model_raises_what_the_stub_says() -> None:
    sched = core.Scheduler(core.ResolvedConfig.for_tests("all", 0), 16, 4)
    ok = {
        "state_bytes": 1,
        "kv_bytes_per_block": 1,
        "flops_per_token": 1.0,
        "attn_flops_per_context_token": 1.0,
    }
    sched.set_cost_model(**ok, flop_weight=0.5)  # type: ignore[arg-type]
    for bad in (
        {"flops_per_token": -1.0},
        {"attn_flops_per_context_token": math.inf},
        {"flop_weight": math.nan},
    ):
        with pytest.raises(InvalidRequestError):
            sched.set_cost_model(**{**ok, **bad})  # type: ignore[arg-type]
    for bad_bytes in ({"state_bytes": -1}, {"kv_bytes_per_block": 2**64}):
        with pytest.raises(OverflowError):
            sched.set_cost_model(**{**ok, **bad_bytes})  # type: ignore[arg-type]
