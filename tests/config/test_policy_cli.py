"""The policy table (tests/config/policy_cases.txt, also driven by the Rust test `policy::tests::table_cases`)
run through `python -m hybridserve config MODEL FLAGS --json`, plus the text output and the exit
status of configuration errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import hybridserve
from cli_fixtures import run_cli
from hybridserve.config import read_model_capabilities
from hybridserve.model.demo import ensure_demo_model

TABLE = Path(__file__).with_name("policy_cases.txt")

HYBRID_CONFIG: dict[str, Any] = {
    "model_type": "nemotron_h",
    "architectures": ["NemotronHForCausalLM"],
    "layers_block_type": ["mamba", "mlp", "mamba", "attention", "mlp", "mamba"],
    "chunk_size": 128,
    "max_position_embeddings": 8192,
}
MODELS: dict[str, dict[str, Any]] = {
    "hybrid": HYBRID_CONFIG,
    "hybrid-nosup": {**HYBRID_CONFIG, "hybridserve": {"supports_boundary_states": False}},
    "attn": {"model_type": "llama", "num_hidden_layers": 2, "max_position_embeddings": 8192},
}


def load_table() -> list[tuple[str, str, str, str]]:
    rows = []
    for line in TABLE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        cols = [c.strip() for c in line.split("|")]
        assert len(cols) == 4, line
        rows.append((cols[0], cols[1], cols[2], cols[3]))
    return rows


CASES = load_table()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    out = {}
    for kind, cfg in MODELS.items():
        d = root / kind
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        out[kind] = d
    return out


def run_config(*args: str) -> subprocess.CompletedProcess[str]:
    # (in this process: test_a_reader_that_goes_away... runs a real one, it needs a pipe)
    return run_cli("config", *args)


def on_off(v: bool) -> str:
    return "on" if v else "off"


def check_ok(d: dict[str, Any], expect: list[str]) -> list[str]:
    failures = []
    codes = {(x["code"], x["level"]) for x in d["decisions"]}
    names = {c for c, _ in codes}
    values = {
        "mode": d["mamba_cache_mode"],
        "pc": on_off(d["enable_prefix_caching"]),
        "chunked": on_off(d["enable_chunked_prefill"]),
        "M": str(d["mamba_block_size"]),
        "T": str(d["max_num_batched_tokens"]),
        "L": str(d["max_model_len"]),
        "k": str(0 if d["speculative"] is None else d["speculative"]["num_speculative_tokens"]),
        "place": d["checkpoint_placement"],
        "evict": d["eviction"],
    }
    for tok in expect:
        if tok.startswith("+"):
            code, _, level = tok[1:].partition(":")
            if not any(c == code and (not level or lv == level) for c, lv in codes):
                failures.append(f"missing decision {tok} in {sorted(codes)}")
        elif tok.startswith("-"):
            if tok[1:] in names:
                failures.append(f"unexpected decision {tok[1:]}")
        else:
            key, _, want = tok.partition("=")
            if values[key] != want:
                failures.append(f"{key}: want {want}, got {values[key]}")
    return failures


def test_table_has_every_rule() -> None:
    rules = {name.split("_")[0] for name, *_ in CASES}
    assert rules == {f"rule{i}" for i in range(1, 9)}
    assert len(CASES) >= 30


@pytest.mark.parametrize(("name", "kind", "flags", "expect"), CASES, ids=[c[0] for c in CASES])
def test_table_case_through_cli(
    model_dirs: dict[str, Path], name: str, kind: str, flags: str, expect: str
) -> None:
    # (the table's draft model "d" is a folder here: `config` refuses a draft folder that is missing)
    flags = flags.replace(
        '"model":"d"', json.dumps({"model": str(model_dirs["hybrid"])}, separators=(",", ":"))[1:-1]
    )
    proc = run_config(str(model_dirs[kind]), *flags.split(), "--json")
    tokens = expect.split()
    if tokens[0] == "ok":
        assert proc.returncode == 0, proc.stderr
        d = json.loads(proc.stdout)
        for key in (
            "enable_prefix_caching",
            "mamba_cache_mode",
            "enable_chunked_prefill",
            "block_size",
            "mamba_block_size",
            "speculative",
            "decisions",
        ):
            assert key in d, key
        spec = d["speculative"]
        assert spec is None or {"method", "num_speculative_tokens"} <= set(spec)
        assert all(set(x) == {"code", "level", "message"} for x in d["decisions"])
        assert check_ok(d, tokens[1:]) == [], name
    else:
        assert tokens[0] == "err"
        assert proc.returncode == 2, (proc.stdout, proc.stderr)
        assert proc.stdout == ""
        err = proc.stderr.strip()
        assert "\n" not in err, "one paragraph"
        assert "ConfigError" in err
        for needle in tokens[1:]:
            assert needle.replace("~", " ") in err, err


def test_explain_lists_every_decision(model_dirs: dict[str, Path]) -> None:
    spec = '{"method":"ngram","num_speculative_tokens":3}'
    proc = run_config(str(model_dirs["hybrid"]), "--speculative-config", spec, "--explain")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "mamba_cache_mode        align" in out
    assert "enable_chunked_prefill  on" in out
    assert "[info] mode_align_for_speculative:" in out
    assert "[info] chunked_prefill_on_for_align:" in out
    d = json.loads(run_config(str(model_dirs["hybrid"]), "--speculative-config", spec, "--json").stdout)
    for dec in d["decisions"]:
        assert f"[{dec['level']}] {dec['code']}: {dec['message']}" in out


def test_plain_output_has_no_decisions(model_dirs: dict[str, Path]) -> None:
    proc = run_config(str(model_dirs["hybrid"]))
    assert proc.returncode == 0, proc.stderr
    assert "mamba_cache_mode        all" in proc.stdout
    assert "decisions:" not in proc.stdout


def test_bad_speculative_json_and_missing_model_exit_2(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    proc = run_config(str(model_dirs["hybrid"]), "--speculative-config", '{"method":"ngram","k":3}')
    assert proc.returncode == 2
    assert "'k'" in proc.stderr and "--speculative-config" in proc.stderr
    proc = run_config(str(model_dirs["hybrid"]), "--speculative-config", "{not json")
    assert proc.returncode == 2
    assert "--speculative-config" in proc.stderr
    proc = run_config(str(tmp_path / "nowhere"))
    assert proc.returncode == 2
    assert "config.json" in proc.stderr


def test_tokenizer_and_draft_folders_are_checked_as_the_engine_checks_them(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    hybrid = str(model_dirs["hybrid"])
    proc = run_config(hybrid, "--tokenizer", str(tmp_path / "nowhere"), "--explain")
    assert proc.returncode == 2
    assert "--tokenizer" in proc.stderr and "tokenizer.json: missing" in proc.stderr
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    assert run_config(hybrid, "--tokenizer", str(tmp_path / "tok")).returncode == 0

    def draft(path: Path) -> subprocess.CompletedProcess[str]:
        spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
        return run_config(hybrid, "--speculative-config", json.dumps(spec))

    proc = draft(tmp_path / "nowhere")
    assert proc.returncode == 2
    assert "--speculative-config" in proc.stderr and "model folder does not exist" in proc.stderr
    proc = draft(tmp_path / "tok")  # a folder without config.json
    assert proc.returncode == 2
    assert "no config.json" in proc.stderr
    assert draft(model_dirs["hybrid"]).returncode == 0


def test_marker_ids_are_checked_against_the_tokenizer_as_the_engine_checks_them() -> None:
    ensure_demo_model()
    proc = run_config("demo", "--shared-prefix-markers", "5,99999")
    assert proc.returncode == 2
    assert "--shared-prefix-markers: 99999 outside the tokenizer's" in proc.stderr
    assert run_config("demo", "--shared-prefix-markers", "5,9").returncode == 0


def test_json_carries_python_side_settings(model_dirs: dict[str, Path]) -> None:
    proc = run_config(
        str(model_dirs["hybrid"]),
        "--dtype",
        "float64",
        "--kv-cache-memory",
        "64MiB",
        "--num-mamba-slots",
        "80",
        "--seed",
        "7",
        "--cache-memory",
        "1GiB",
        "--cpu-threads",
        "1",
        "--shared-prefix-markers",
        "5,9",
        "--grammar-compile-timeout",
        "2.5",
        "--prefix-cache-hash-seed",
        "987654321",
        "--kv-events-config",
        '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6001"}',
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert d["shared_prefix_markers"] == [5, 9]
    assert d["grammar_compile_timeout"] == 2.5
    assert d["tensor_parallel_size"] == 1
    assert d["kv_events"]["enable_kv_cache_events"] is True and d["kv_events"]["endpoint"] == "tcp://*:6001"
    # the hash seed is a secret: the output says it was given, never what it is
    assert d["prefix_cache_hash_seed_given"] is True and "987654321" not in proc.stdout
    assert d["dtype"] == "float64"
    assert d["cache_memory"] == 2**30
    assert d["cpu_threads"] == 1
    assert d["kv_cache_memory"] == 64 * 2**20
    assert d["num_mamba_slots"] == 80
    assert d["seed"] == 7
    assert d["capabilities"]["has_mamba_layers"] is True
    assert d["capabilities"]["scan_chunk_size"] == 128
    assert d["capabilities"]["num_mamba_layers"] == 3


@pytest.mark.parametrize(
    "change, names",
    [
        ({"chunk_size": 2**63}, "chunk_size"),
        ({"chunk_size": 1e30}, "chunk_size"),
        ({"chunk_size": "abc"}, "chunk_size"),
        ({"chunk_size": 128.7}, "chunk_size"),
        ({"max_position_embeddings": 2**63}, "max_position_embeddings"),
        ({"max_position_embeddings": 0}, "max_position_embeddings"),
        ({"max_position_embeddings": "abc"}, "max_position_embeddings"),
        ({"hybridserve": {"supports_boundary_states": "false"}}, "supports_boundary_states"),
        ({"hybridserve": {"scan_chunk_size": "x"}}, "scan_chunk_size"),
        ({"hybridserve": {"scan_chunk_size": 0}}, "scan_chunk_size"),
    ],
)
def test_bad_capability_values_in_config_json_are_one_line_errors(
    tmp_path: Path, change: dict[str, Any], names: str
) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**HYBRID_CONFIG, **change}))
    proc = run_config(str(d))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and names in proc.stderr and "config.json" in proc.stderr
    with pytest.raises(hybridserve.ConfigError, match=names):
        read_model_capabilities(d)


@pytest.mark.parametrize("flag", ["--json", "--explain"])
def test_a_reader_that_goes_away_ends_the_command_quietly(model_dirs: dict[str, Path], flag: str) -> None:
    """`hybridserve config ... | head -1`: the reader closes the pipe before the output is written.
    The command ends as SIGPIPE would end it (141), with no traceback."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "hybridserve", "config", str(model_dirs["hybrid"]), flag],
            stdout=write, stderr=subprocess.PIPE, text=True, timeout=60,
        )  # fmt: skip
    finally:
        os.close(write)
    assert proc.returncode == 141, proc.stderr
    assert proc.stderr == ""


def test_vllm_s_spellings_of_flags_and_of_the_model(model_dirs: dict[str, Path]) -> None:
    """vLLM takes `--flag_name` for `--flag-name`, and `--model M` for MODEL: the command lines
    model cards give use both (NVIDIA's: `--model ... --mamba_ssm_cache_dtype float32`)."""
    hybrid, attn = str(model_dirs["hybrid"]), str(model_dirs["attn"])
    proc = run_config("--model", hybrid, "--max_num_seqs", "8", "--mamba_ssm_cache_dtype=float32", "--json")
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert (d["model"], d["max_num_seqs"], d["mamba_ssm_cache_dtype"]) == (hybrid, 8, "float32")
    from hybridserve.model.demo import ensure_demo_model

    ensure_demo_model()  # (a model with weights: its plan says what the states take)
    proc = run_config("--model", "demo", "--mamba_ssm_cache_dtype=float32", "--json")
    said = {x["code"]: x["message"] for x in json.loads(proc.stdout)["decisions"]}
    assert "Mamba states in float32 (--mamba-ssm-cache-dtype)" in said["mamba_ssm_cache_dtype"]
    assert run_config(hybrid, "--model", hybrid).returncode == 0  # (the same model twice)
    proc = run_config(hybrid, "--model", attn)
    assert proc.returncode == 2 and "differ" in proc.stderr
    proc = run_config("--json")
    assert proc.returncode == 2 and "MODEL is required" in proc.stderr
    proc = run_config(hybrid, "--mamba_ssm_cache_dtype", "bfloat16")  # (vLLM's; not served here)
    assert proc.returncode == 2 and "--mamba-ssm-cache-dtype" in proc.stderr


def test_kv_cache_dtype_is_a_decision_with_its_reason() -> None:
    """NVIDIA's FP8 cards pass `--kv-cache-dtype fp8`: the plan says what the cache takes and why."""
    from hybridserve.model.demo import ensure_demo_model

    ensure_demo_model()

    def said(*flags: str) -> str:
        proc = run_config("demo", "--dtype", "float32", *flags, "--json")
        assert proc.returncode == 0, proc.stderr
        return {x["code"]: x["message"] for x in json.loads(proc.stdout)["decisions"]}["kv_cache_dtype"]

    assert said() == "KV cache in float32 (default: the model dtype)"
    fp8 = said("--kv_cache_dtype", "fp8")
    assert fp8.startswith("KV cache in float8_e4m3fn (--kv-cache-dtype; K and V are rounded to float8_e4m3fn")
    assert said("--kv-cache-dtype", "float32") == "KV cache in float32 (--kv-cache-dtype)"
    proc = run_config("demo", "--kv-cache-dtype", "fp8_inc")
    assert proc.returncode == 2 and "--kv-cache-dtype" in proc.stderr and "fp8_e5m2" in proc.stderr


def test_only_the_names_of_known_flags_are_respelled() -> None:
    from hybridserve.cli import _flags, build_parser
    from hybridserve.config.cli import normalize_flag_names

    known = _flags(build_parser())
    assert {"--max-num-seqs", "--chat-template", "--served-model-name", "--num-prompts"} <= known
    argv = ["serve", "my_model", "--max_num_seqs=8", "--chat_template", "a_b.jinja", "--prompt", "--snake_case",
            "--policy_file", "-tp", "2", "--", "--max_num_seqs"]  # fmt: skip
    assert normalize_flag_names(argv, known) == [
        "serve",
        "my_model",
        "--max-num-seqs=8",
        "--chat-template",
        "a_b.jinja",
        "--prompt",
        "--snake_case",  # (not a flag of ours: a value, or another program's)
        "--policy_file",
        "-tp",
        "2",
        "--",
        "--max_num_seqs",
    ]
