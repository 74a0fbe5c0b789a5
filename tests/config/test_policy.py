"""EngineArgs, SpeculativeConfig, model capabilities and the `_core` policy bindings."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hybridserve
import hybridserve._core as core
from hybridserve.config import (
    EngineArgs,
    ModelCapabilities,
    ResolvedEngineConfig,
    SpeculativeConfig,
    add_config_args,
    add_engine_args,
    log_decisions,
    parse_bytes,
    read_model_capabilities,
)

HYBRID = ModelCapabilities(
    model_type="nemotron_h",
    has_mamba_layers=True,
    supports_boundary_states=True,
    scan_chunk_size=128,
    max_position_embeddings=8192,
)
NGRAM3 = {"method": "ngram", "num_speculative_tokens": 3}


def codes(resolved: ResolvedEngineConfig) -> set[str]:
    return {d.code for d in resolved.decisions}


# ---------------------------------------------------------------- the seed's cases, from Python


def test_seed_prefix_caching_with_speculation_gives_align_with_chunked_prefill() -> None:
    r = EngineArgs(model="m", enable_prefix_caching=True, speculative_config=NGRAM3).resolve(HYBRID)
    assert r.core.mamba_cache_mode == "align"
    assert r.core.enable_chunked_prefill is True
    assert {"mode_align_for_speculative", "chunked_prefill_on_for_align"} <= codes(r)
    assert r.core.num_speculative_tokens == 3
    assert r.core.speculative_method == "ngram"


def test_seed_prefix_caching_without_speculation_gives_all() -> None:
    r = EngineArgs(model="m", enable_prefix_caching=True).resolve(HYBRID)
    assert r.core.mamba_cache_mode == "all"
    assert "mode_all_default" in codes(r)


def test_seed_chunked_prefill_off_with_speculation_names_both_fixes() -> None:
    args = EngineArgs(
        model="m", enable_prefix_caching=True, speculative_config=NGRAM3, enable_chunked_prefill=False
    )
    with pytest.raises(hybridserve.ConfigError) as e:
        args.resolve(HYBRID)
    assert "--enable-chunked-prefill" in str(e.value)
    assert "--mamba-cache-mode all" in str(e.value)
    assert isinstance(e.value, hybridserve.HybridServeError)


# ---------------------------------------------------------------- EngineArgs


def test_defaults_and_auto_mamba_block_size() -> None:
    r = EngineArgs(model="m").resolve(HYBRID)
    c = r.core
    assert (c.block_size, c.mamba_block_size, c.scan_chunk_size) == (16, 256, 128)
    assert (c.max_num_seqs, c.max_num_batched_tokens, c.max_model_len) == (64, 2048, 8192)
    assert c.enable_prefix_caching and c.enable_chunked_prefill and c.has_mamba_layers
    assert r.dtype == "float32"
    assert r.speculative is None
    # attributes of the Rust config are readable on the wrapper too
    assert r.mamba_block_size == 256 and r.config is r.core
    assert core.auto_mamba_block_size(16, 128) == 256
    assert core.auto_mamba_block_size(48, 128) == 384
    assert core.auto_mamba_block_size(16, 100) == 400


def test_enums_and_strings_are_both_accepted() -> None:
    a = EngineArgs(model="m", mamba_cache_mode="align").resolve(HYBRID)
    b = EngineArgs(model="m", mamba_cache_mode="align").resolve(HYBRID)
    assert a.core.mamba_cache_mode == b.core.mamba_cache_mode == "align"
    direct = core.resolve_policy(
        has_mamba_layers=True,
        supports_boundary_states=True,
        scan_chunk_size=128,
        enable_prefix_caching="on",
        enable_chunked_prefill="off",
        mamba_cache_mode="all",
        speculative_method="draft_model",
        num_speculative_tokens=2,
    )
    assert direct.mamba_cache_mode == "all"
    assert direct.enable_chunked_prefill is False
    assert direct.speculative_method == "draft_model"
    with pytest.raises(hybridserve.ConfigError, match="--mamba-cache-mode"):
        EngineArgs(model="m", mamba_cache_mode="fast").resolve(HYBRID)
    with pytest.raises(hybridserve.ConfigError, match="--enable-prefix-caching"):
        core.resolve_policy(
            has_mamba_layers=True, supports_boundary_states=True, enable_prefix_caching="maybe"
        )


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}, "'lookahead'"),
        ({"num_speculative_tokens": 3}, "'method'"),
        ({"method": "eagle", "num_speculative_tokens": 3}, "'method'"),
        ({"method": "ngram"}, "'num_speculative_tokens'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "'num_speculative_tokens'"),
        ({"method": "ngram", "num_speculative_tokens": 99}, "'num_speculative_tokens'"),
        ({"method": "ngram", "num_speculative_tokens": True}, "'num_speculative_tokens'"),
        ({"method": "ngram", "num_speculative_tokens": "3"}, "'num_speculative_tokens'"),
        ({"method": "draft_model", "num_speculative_tokens": 3}, "'model'"),
        ({"method": "ngram", "num_speculative_tokens": 3, "model": "x"}, "'model'"),
        (
            {"method": "draft_model", "num_speculative_tokens": 3, "model": "x", "prompt_lookup_max": 2},
            "'prompt_lookup_max'",
        ),
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}, "'prompt_lookup_min'"),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
            "'prompt_lookup_min'",
        ),
    ],
)
def test_bad_speculative_config_names_the_key(spec: dict[str, Any], needle: str) -> None:
    with pytest.raises(hybridserve.ConfigError) as e:
        EngineArgs(model="m", speculative_config=spec).resolve(HYBRID)
    assert needle in str(e.value)
    assert "--speculative-config" in str(e.value)


def test_speculative_config_defaults() -> None:
    s = SpeculativeConfig.from_dict(NGRAM3)
    assert (s.prompt_lookup_min, s.prompt_lookup_max) == (1, 4)
    assert SpeculativeConfig.from_dict({**NGRAM3, "prompt_lookup_max": 2}).prompt_lookup_min == 1
    assert SpeculativeConfig.from_dict({**NGRAM3, "prompt_lookup_min": 6}).prompt_lookup_max == 6
    d = SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 2, "model": "demo"})
    assert d.to_dict() == {"method": "draft_model", "num_speculative_tokens": 2, "model": "demo"}
    # vLLM's spellings without a method: a model is a draft model; "ngram" / "[ngram]" n-gram
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "model": "demo"}) == d
    for name in ("ngram", "[ngram]"):
        for method in ({}, {"method": None}, {"method": "ngram"}):
            spelled = {**method, "num_speculative_tokens": 3, "model": name}
            assert SpeculativeConfig.from_dict(spelled) == SpeculativeConfig.from_dict(NGRAM3)
    with pytest.raises(hybridserve.ConfigError, match="'method' is required"):
        SpeculativeConfig.from_dict({"num_speculative_tokens": 2})
    with pytest.raises(hybridserve.ConfigError, match="'model' applies to method draft_model only"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "model": "demo"})


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("block_size", 0, "--block-size"),
        ("max_num_seqs", -1, "--max-num-seqs"),
        ("max_num_batched_tokens", 0, "--max-num-batched-tokens"),
        ("max_model_len", True, "--max-model-len"),
        ("mamba_block_size", 2.5, "--mamba-block-size"),
        ("dtype", "int8", "--dtype"),
        ("device", "tpu", "--device"),
        ("seed", -3, "--seed"),
        ("kv_cache_memory", 0, "--kv-cache-memory"),
        ("num_kv_blocks", 1, "--num-kv-blocks"),
        ("num_mamba_slots", 0, "--num-mamba-slots"),
        ("max_queue_len", 0, "--max-queue-len"),
        ("enable_prefix_caching", "yes", "--enable-prefix-caching"),
        ("cache_memory", 0, "--cache-memory"),
        ("cpu_threads", 0, "--cpu-threads"),
    ],
)
def test_bad_field_values_name_the_flag(field: str, value: Any, flag: str) -> None:
    with pytest.raises(hybridserve.ConfigError) as e:
        EngineArgs(model="m", **{field: value}).resolve(HYBRID)
    assert flag in str(e.value)


def test_pool_overrides_are_checked_against_the_config() -> None:
    # 8192 tokens of 16 need 512 blocks + the null block.
    EngineArgs(model="m", num_kv_blocks=513).resolve(HYBRID)
    with pytest.raises(hybridserve.ConfigError, match="--num-kv-blocks"):
        EngineArgs(model="m", num_kv_blocks=512).resolve(HYBRID)
    with pytest.raises(hybridserve.ConfigError, match="--num-mamba-slots"):
        EngineArgs(model="m", num_mamba_slots=4, speculative_config=NGRAM3).resolve(HYBRID)
    # the engine needs a window of 1 + K slots for each of max_num_seqs sequences: so does resolve
    with pytest.raises(
        hybridserve.ConfigError, match="--num-mamba-slots 5: --max-num-seqs 2 running sequences"
    ):
        EngineArgs(model="m", num_mamba_slots=5, max_num_seqs=2, speculative_config=NGRAM3).resolve(HYBRID)
    EngineArgs(model="m", num_mamba_slots=9, max_num_seqs=2, speculative_config=NGRAM3).resolve(HYBRID)
    EngineArgs(model="m", num_mamba_slots=5, max_num_seqs=1, speculative_config=NGRAM3).resolve(HYBRID)
    # max_num_seqs unset: the engine lowers it to what the slots run, so one window must fit,
    # with its checkpoint slot where prefix caching is on (as the sizing counts them)
    EngineArgs(model="m", num_mamba_slots=6, speculative_config=NGRAM3).resolve(HYBRID)
    with pytest.raises(
        hybridserve.ConfigError,
        match="one running sequence with a window of 4 slots and a checkpoint slot needs 6",
    ):
        EngineArgs(model="m", num_mamba_slots=5, speculative_config=NGRAM3).resolve(HYBRID)
    no_cache = {"speculative_config": NGRAM3, "enable_prefix_caching": False}
    EngineArgs(model="m", num_mamba_slots=5, **no_cache).resolve(HYBRID)
    with pytest.raises(
        hybridserve.ConfigError, match="one running sequence with a window of 4 slots needs 5"
    ):
        EngineArgs(model="m", num_mamba_slots=4, **no_cache).resolve(HYBRID)


def test_dtype_auto_follows_the_model() -> None:
    caps = ModelCapabilities(**{**HYBRID.to_dict(), "torch_dtype": "bfloat16"})
    r = EngineArgs(model="m").resolve(caps)
    assert r.dtype == "bfloat16"
    assert "dtype_auto" in codes(r)
    assert EngineArgs(model="m", dtype="float64").resolve(caps).dtype == "float64"


def test_capabilities_from_any_object() -> None:
    loader_like = SimpleNamespace(
        architecture="NemotronHForCausalLM",
        has_mamba_layers=True,
        supports_boundary_states=False,
        chunk_size=64,
        max_position_embeddings=1024,
    )
    r = EngineArgs(model="m").resolve(loader_like)
    assert r.core.scan_chunk_size == 64
    assert r.core.max_model_len == 1024
    assert r.core.mamba_cache_mode == "align"  # no boundary states
    r = EngineArgs(model="m").resolve({"has_mamba_layers": False, "max_position_embeddings": 512})
    assert r.core.mamba_cache_mode == "none" and not r.core.has_mamba_layers


def test_to_dict_round_trips_through_json() -> None:
    r = EngineArgs(model="m", speculative_config=NGRAM3, kv_cache_memory=1 << 20).resolve(HYBRID)
    d = json.loads(json.dumps(r.to_dict()))
    assert d["speculative"] == {**NGRAM3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    assert d["mamba_cache_mode"] == "align"
    assert d["kv_cache_memory"] == 1 << 20
    assert [x["code"] for x in d["decisions"]] == [x.code for x in r.decisions]
    a = json.loads(json.dumps(EngineArgs(model="m", speculative_config=NGRAM3).to_dict()))
    assert a["speculative_config"] == NGRAM3 and a["mamba_cache_mode"] == "auto"


def test_parse_bytes() -> None:
    assert parse_bytes("1024") == 1024
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("4GiB") == 4 * 2**30
    assert parse_bytes("1.5GB") == 1_500_000_000
    # exact past float's 53 bits, and no float overflow for a number of any length (the flag's
    # own bound refuses it later, naming the flag)
    assert parse_bytes("9007199254740993") == 2**53 + 1
    assert parse_bytes("0.1KiB") == 102
    assert parse_bytes("9" * 400) == 10**400 - 1
    for bad in ("", "-1", "12XB", "0", "٣", "1e3"):  # "٣" is a digit to str and to float()
        with pytest.raises(hybridserve.ConfigError):
            parse_bytes(bad, "--kv-cache-memory")
    # the keyword arguments take what the flags take (LLM(..., cache_memory="3GiB"), as the CLI)
    a = EngineArgs(model="m", kv_cache_memory="512MiB", mamba_cache_memory="1024", cache_memory="1.5GB")
    assert (a.kv_cache_memory, a.mamba_cache_memory, a.cache_memory) == (512 * 2**20, 1024, 1_500_000_000)
    with pytest.raises(hybridserve.ConfigError, match="--mamba-cache-memory must be a byte count"):
        EngineArgs(model="m", mamba_cache_memory="lots")


# ---------------------------------------------------------------- CLI plumbing


def test_from_cli_reads_every_flag() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    ns = p.parse_args(
        [
            "some/model",
            "--no-enable-prefix-caching",
            "--mamba-cache-mode",
            "none",
            "--enable-chunked-prefill",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 2}',
            "--block-size",
            "32",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "4096",
            "--max-model-len",
            "1024",
            "--dtype",
            "float64",
            "--device",
            "cpu",
            "--seed",
            "5",
            "--kv-cache-memory",
            "1GiB",
            "--mamba-cache-memory",
            "2048",
            "--num-kv-blocks",
            "100",
            "--num-mamba-slots",
            "50",
        ]
    )
    a = EngineArgs.from_cli(ns)
    assert a == EngineArgs(
        model="some/model",
        enable_prefix_caching=False,
        mamba_cache_mode="none",
        enable_chunked_prefill=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        block_size=32,
        max_num_seqs=8,
        max_num_batched_tokens=4096,
        max_model_len=1024,
        dtype="float64",
        device="cpu",
        seed=5,
        kv_cache_memory=2**30,
        mamba_cache_memory=2048,
        num_kv_blocks=100,
        num_mamba_slots=50,
    )
    defaults = EngineArgs.from_cli(p.parse_args(["m"]))
    assert defaults == EngineArgs(model="m")
    assert defaults.enable_prefix_caching is None and defaults.enable_chunked_prefill is None


def test_add_engine_args_keeps_an_existing_model_positional() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    add_engine_args(p)
    assert EngineArgs.from_cli(p.parse_args(["x"])).model == "x"
    # and `config` adds its own flags on top without clashes
    q = argparse.ArgumentParser()
    add_config_args(q)
    ns = q.parse_args(["x", "--json", "--max-queue-len", "9"])
    assert ns.json and EngineArgs.from_cli(ns).max_queue_len == 9


def test_log_decisions(caplog: pytest.LogCaptureFixture) -> None:
    r = EngineArgs(model="m", mamba_cache_mode="none").resolve(HYBRID)
    log = logging.getLogger("test.policy")
    with caplog.at_level(logging.INFO, logger="test.policy"):
        log_decisions(r, log)
    msgs = [(rec.levelno, rec.getMessage()) for rec in caplog.records]
    assert msgs[0][0] == logging.INFO and "mamba_cache_mode none" in msgs[0][1]
    assert (logging.WARNING, f"config decision mode_none_no_hits: {_msg(r, 'mode_none_no_hits')}") in msgs
    assert len(msgs) == 1 + len(r.decisions)


def _msg(r: ResolvedEngineConfig, code: str) -> str:
    return next(d.message for d in r.decisions if d.code == code)


def test_read_model_capabilities(tmp_path: Path) -> None:
    def caps(cfg: dict[str, Any]) -> ModelCapabilities:
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        return read_model_capabilities(tmp_path)

    c = caps(
        {"model_type": "nemotron_h", "hybrid_override_pattern": "M-M*-", "max_position_embeddings": 4096}
    )
    assert (c.has_mamba_layers, c.supports_boundary_states, c.scan_chunk_size) == (True, True, 128)
    assert (c.num_mamba_layers, c.num_attention_layers, c.max_position_embeddings) == (2, 1, 4096)
    c = caps(
        {"model_type": "bamba", "num_hidden_layers": 8, "attn_layer_indices": [3], "mamba_chunk_size": 64}
    )
    assert (c.has_mamba_layers, c.num_mamba_layers, c.num_attention_layers, c.scan_chunk_size) == (
        True,
        7,
        1,
        64,
    )
    c = caps({"model_type": "mamba2", "num_hidden_layers": 4, "chunk_size": 256})
    assert (c.has_mamba_layers, c.num_mamba_layers, c.max_position_embeddings) == (True, 4, None)
    c = caps({"model_type": "nemotron_h", "layers_block_type": ["attention", "mlp"], "chunk_size": 128})
    assert not c.has_mamba_layers and c.scan_chunk_size is None
    c = caps({"model_type": "llama", "num_hidden_layers": 2, "torch_dtype": "bfloat16"})
    assert not c.has_mamba_layers and c.torch_dtype == "bfloat16"
    c = caps(
        {
            "model_type": "nemotron_h",
            "hybrid_override_pattern": "M*",
            "hybridserve": {"supports_boundary_states": False},
        }
    )
    assert c.has_mamba_layers and not c.supports_boundary_states
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(hybridserve.ConfigError, match="config.json"):
        read_model_capabilities(tmp_path)
    with pytest.raises(hybridserve.ConfigError, match="config.json"):
        read_model_capabilities(tmp_path / "missing")


def test_resolve_without_caps_reads_the_model_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "nemotron_h",
                "hybrid_override_pattern": "M*",
                "chunk_size": 64,
                "max_position_embeddings": 2048,
            }
        )
    )
    r = EngineArgs(model=str(tmp_path)).resolve()
    assert r.model_dir == str(tmp_path)
    assert (r.core.scan_chunk_size, r.core.max_model_len, r.core.mamba_cache_mode) == (64, 2048, "all")


def test_config_module_does_not_import_torch() -> None:
    code = "import sys, hybridserve.config, hybridserve.cli; hybridserve.cli.build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------- _core bindings


def test_for_tests_and_pool_sizes() -> None:
    cfg = core.ResolvedConfig.for_tests("align", 2)
    assert (cfg.block_size, cfg.mamba_block_size, cfg.num_speculative_tokens, cfg.state_window_len) == (
        4,
        8,
        2,
        3,
    )
    assert cfg.decisions == []
    cfg.validate_pool_sizes(1 + (4096 + 2 + 3) // 4, 4)
    with pytest.raises(hybridserve.ConfigError, match="--num-kv-blocks"):
        cfg.validate_pool_sizes(10, 4)
    with pytest.raises(hybridserve.ConfigError):
        core.ResolvedConfig.for_tests("auto")
    assert "align" in repr(cfg)
    d = cfg.to_dict()
    assert d["speculative"] == {"method": "ngram", "num_speculative_tokens": 2}


@settings(max_examples=300, deadline=None)
@given(
    mamba=st.booleans(),
    sup=st.booleans(),
    q=st.one_of(st.none(), st.integers(-2, 5000)),
    pc=st.sampled_from([None, True, False]),
    mode=st.sampled_from(["auto", "none", "align", "all"]),
    cp=st.sampled_from([None, True, False]),
    k=st.integers(-1, 20),
    method=st.sampled_from([None, "ngram", "draft_model"]),
    b=st.integers(-1, 2000),
    m=st.one_of(st.none(), st.integers(-1, 5000)),
    t=st.one_of(st.none(), st.integers(-1, 10000)),
    seqs=st.integers(-1, 100),
    length=st.one_of(st.none(), st.integers(-1, 20000)),
)
def test_resolve_policy_only_raises_config_errors(**kw: Any) -> None:
    try:
        cfg = core.resolve_policy(
            has_mamba_layers=kw["mamba"],
            supports_boundary_states=kw["sup"],
            scan_chunk_size=kw["q"],
            max_position_embeddings=8192,
            enable_prefix_caching=kw["pc"],
            mamba_cache_mode=kw["mode"],
            enable_chunked_prefill=kw["cp"],
            speculative_method=kw["method"],
            num_speculative_tokens=kw["k"] if kw["method"] else 0,
            block_size=kw["b"],
            mamba_block_size=kw["m"],
            max_num_batched_tokens=kw["t"],
            max_num_seqs=kw["seqs"],
            max_model_len=kw["length"],
        )
    except hybridserve.ConfigError as e:
        assert "--" in str(e) or "config.json" in str(e)
        return
    assert cfg.mamba_cache_mode != "align" or cfg.enable_chunked_prefill
    assert cfg.mamba_cache_mode != "all" or kw["sup"]
    assert cfg.mamba_block_size % cfg.block_size == 0
    if kw["pc"] is not None:
        assert cfg.enable_prefix_caching == kw["pc"]
    if kw["cp"] is not None:
        assert cfg.enable_chunked_prefill == kw["cp"]
    d = cfg.to_dict()
    assert d["mamba_cache_mode"] == cfg.mamba_cache_mode
    assert [x["code"] for x in d["decisions"]] == [x.code for x in cfg.decisions]


@pytest.mark.parametrize(
    "field, value",
    [
        ("has_mamba_layers", "false"),
        ("supports_boundary_states", 1),
        ("scan_chunk_size", "abc"),
        ("scan_chunk_size", 2**63),
        ("max_position_embeddings", 2**63),
        ("max_position_embeddings", 4096.9),
        ("num_mamba_layers", -1),
    ],
)
def test_capabilities_of_the_wrong_type_are_config_errors(field: str, value: object) -> None:
    caps = {**HYBRID.to_dict(), field: value}
    with pytest.raises(hybridserve.ConfigError, match=field):
        EngineArgs(model="m").resolve(caps)
    with pytest.raises(hybridserve.ConfigError, match=field):
        ModelCapabilities(**caps)


def test_the_way_out_of_align_without_chunked_prefill_exists_on_the_model() -> None:
    nosup = ModelCapabilities(**{**HYBRID.to_dict(), "supports_boundary_states": False})
    for kw in (
        {"mamba_cache_mode": "align"},
        {"speculative_config": NGRAM3},
    ):
        with pytest.raises(hybridserve.ConfigError, match="choose --mamba-cache-mode all"):
            EngineArgs(model="m", enable_chunked_prefill=False, **kw).resolve(HYBRID)
        with pytest.raises(hybridserve.ConfigError) as ei:
            EngineArgs(model="m", enable_chunked_prefill=False, **kw).resolve(nosup)
        assert "choose --mamba-cache-mode all" not in str(ei.value)
        assert "--mamba-cache-mode none" in str(ei.value)
        # and the suggested way out resolves
        EngineArgs(
            model="m",
            enable_chunked_prefill=False,
            mamba_cache_mode="none",
            **{k: v for k, v in kw.items() if k != "mamba_cache_mode"},
        ).resolve(nosup)


def test_max_model_len_leaves_room_for_a_prompt_and_a_token() -> None:
    with pytest.raises(hybridserve.ConfigError, match=r"--max-model-len must be an integer in \[2, "):
        EngineArgs(model="m", max_model_len=1).resolve(HYBRID)
    with pytest.raises(hybridserve.ConfigError, match="--max-model-len must be in 2"):
        core.resolve_policy(has_mamba_layers=False, supports_boundary_states=False, max_model_len=1)
    r = EngineArgs(model="m", max_model_len=2).resolve(HYBRID)
    core.Scheduler(r.core, 8, 64)  # what the policy accepts, the scheduler takes
