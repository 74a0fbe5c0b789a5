"""`--config FILE` (vLLM's): a subcommand's flags from a YAML mapping. The file's flags go first so
that the command line's own win; each shape of value becomes the tokens argparse takes; a file
or a key that cannot be used is an error naming it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cli_fixtures import run_cli
from hybridserve.cli import build_parser
from hybridserve.config.config_file import expand_config_files
from hybridserve.errors import ConfigError


def _file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "flags.yaml"
    path.write_text(text)
    return str(path)


def test_each_shape_of_value_becomes_the_flag_s_tokens(tmp_path: Path) -> None:
    path = _file(
        tmp_path,
        """
model: demo
port: 8001
max_num_seqs: 32
--cpu-threads: 1
enable-prefix-caching: false
async-scheduling: true
trust-remote-code: true
disable-log-stats: false
speculative-config: {method: ngram, num_speculative_tokens: 3}
served-model-name: [demo, tiny]
""",
    )
    argv, model = expand_config_files(build_parser(), ["serve", "--config", path, "--port", "9000", "mine"])
    assert model == "demo"
    # the command line's own first (its --port: the file's is left out), then the file's
    assert argv == [
        "serve", "--port", "9000", "mine",
        "--max-num-seqs=32",
        "--cpu-threads=1",
        "--no-enable-prefix-caching",
        "--async-scheduling",
        "--trust-remote-code",
        "--speculative-config=" + json.dumps({"method": "ngram", "num_speculative_tokens": 3}),
        "--served-model-name", "demo", "tiny",
    ]  # fmt: skip
    args = build_parser().parse_args(argv)
    # a list last in the file takes none of the command line's words: MODEL stays the command line's
    assert (args.port, args.max_num_seqs, args.model, args.served_model_name) == (
        9000,
        32,
        "mine",
        ["demo", "tiny"],
    )


def test_a_no_spelling_and_a_list_of_an_appending_flag(tmp_path: Path) -> None:
    path = _file(tmp_path, "no-enable-prefix-caching: false\nprompt: [a, b]\nstop: x\n")
    argv, _ = expand_config_files(build_parser(), ["generate", "demo", "--config", path])
    assert argv == ["generate", "demo", "--enable-prefix-caching", "--prompt=a", "--prompt=b", "--stop=x"]
    args = build_parser().parse_args(argv)
    assert (args.enable_prefix_caching, args.prompt, args.stop) == (True, ["a", "b"], ["x"])


def test_the_command_line_wins_for_every_kind_of_flag(tmp_path: Path) -> None:
    path = _file(tmp_path, "stop: [a, b]\nenable-prefix-caching: true\nseed: -3\nmax-tokens: 4\n")
    argv, _ = expand_config_files(
        build_parser(), ["generate", "demo", "--stop", "c", "--no-enable-prefix-caching", "--config", path]
    )
    args = build_parser().parse_args(argv)
    # an appending flag is the command line's alone; a --no- form counts as the flag; a value that
    # starts with "-" stays a value
    assert (args.stop, args.enable_prefix_caching, args.seed, args.max_tokens) == (["c"], False, -3, 4)


def test_the_file_s_model_for_each_subcommand(tmp_path: Path) -> None:
    path = _file(tmp_path, "model: demo\n")
    for argv in (["serve"], ["config"], ["generate"]):
        expanded, model = expand_config_files(build_parser(), [*argv, "--config", path])
        assert (expanded, model) == (argv, "demo")  # (taken by the caller when MODEL is not given)
    # bench offline's MODEL is a flag of its own: the file's is that flag, unless the command line's
    expanded, model = expand_config_files(build_parser(), ["bench", "offline", "--config", path])
    assert (expanded, model) == (["bench", "offline", "--model=demo"], None)
    expanded, _ = expand_config_files(
        build_parser(), ["bench", "offline", "--model", "x", f"--config={path}"]
    )
    assert expanded == ["bench", "offline", "--model", "x"]


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("- a\n- b\n", "must be a mapping"),
        ("port: [8000\n", "not YAML"),
        ("no-such-flag: 1\n", "'no-such-flag' is not a flag of this command"),
        ("config: other.yaml\n", "'config' is not a flag"),
        ("enable-prefix-caching: 1\n", "enable-prefix-caching is true or false"),
        ("max-num-seqs: [1, 2]\n", "max-num-seqs takes one value"),
        ("max-num-seqs: null\n", "max-num-seqs takes one value"),
        ("served-model-name: []\n", "needs at least one value"),
        ("12: 3\n", "is not a flag name"),
        ("tp: 2\n", "'tp' is a short flag; write its long name (--tensor-parallel-size)"),
        ("max-num-seqs: 2024-01-01\n", '"2024-01-01" (a date) is not a flag value'),
        ("enable-prefix-caching: 2024-01-01\n", 'is true or false, got "2024-01-01"'),
        # a value the flag itself refuses: its check runs here, naming the key
        ("max-num-seqs: {a: 1}\n", 'max-num-seqs: not an integer (got {"a": 1})'),
        ("max-num-seqs: 1e3\n", "max-num-seqs: not an integer (got 1e3)"),
        (
            "dtype: float8\n",
            "dtype: one of auto, float32, bfloat16, float16, float64, half, float, double (got float8)",
        ),
        ("port: 70000\n", "port: must be in [0, 65535], got 70000"),
        # two spellings of one flag: the last would win without a word
        ("max-num-seqs: 4\nmax_num_seqs: 8\n", "'max-num-seqs' and 'max_num_seqs' set the same flag"),
        (
            "enable-prefix-caching: true\nno-enable-prefix-caching: true\n",
            "'enable-prefix-caching' and 'no-enable-prefix-caching' set the same flag",
        ),
    ],
)
def test_what_cannot_be_read_is_an_error_naming_the_file(tmp_path: Path, text: str, said: str) -> None:
    path = _file(tmp_path, text)
    with pytest.raises(ConfigError, match="--config .*flags.yaml") as e:
        expand_config_files(build_parser(), ["serve", "--config", path])
    assert said in str(e.value)


def test_a_refused_value_is_shown_once(tmp_path: Path) -> None:
    for text, end in (("port: 70000\n", "got 70000"), ("max-num-seqs: many\n", "not an integer (got many)")):
        with pytest.raises(ConfigError) as e:
            expand_config_files(build_parser(), ["serve", "--config", _file(tmp_path, text)])
        assert str(e.value).endswith(end), str(e.value)


def test_an_empty_config_path_is_said_so() -> None:
    with pytest.raises(ConfigError, match="^--config: empty; give a YAML file$"):
        expand_config_files(build_parser(), ["serve", "--config="])


def _config(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("config", *args)


def test_no_flag_is_abbreviated(tmp_path: Path) -> None:
    """`--conf FILE` would set --config's value without the file being read."""
    proc = _config("demo", "--conf", _file(tmp_path, "max-num-seqs: 3\n"))
    assert proc.returncode == 2 and "unrecognized arguments: --conf" in proc.stderr


def test_hybridserve_config_reads_the_file(tmp_path: Path) -> None:
    path = _file(tmp_path, "model: demo\nmax_num_seqs: 8\nmax-logprobs: 5\nenable_prefix_caching: false\n")
    proc = _config("--config", path, "--json")
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert (d["model"], d["max_num_seqs"], d["max_logprobs"], d["enable_prefix_caching"]) == (
        "demo",
        8,
        5,
        False,
    )
    proc = _config("--config", path, "--max-num-seqs", "4", "--json")  # the command line wins
    assert json.loads(proc.stdout)["max_num_seqs"] == 4
    missing = _config("--config", str(tmp_path / "nowhere.yaml"))
    assert missing.returncode == 2 and "nowhere.yaml: cannot read it" in missing.stderr
    bad = _config("--config", _file(tmp_path, "max-num-seqs: many\n"))
    assert bad.returncode == 2 and "flags.yaml: max-num-seqs: not an integer (got many)" in bad.stderr


def test_generate_takes_the_file_s_model_and_flags(tmp_path: Path) -> None:
    path = _file(tmp_path, "model: demo\nmax-tokens: 3\ntemperature: 0\nignore-eos: true\njson: true\n")
    proc = subprocess.run(
        [sys.executable, "-m", "hybridserve", "generate", "--config", path, "--prompt", "Hello"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (line,) = proc.stdout.splitlines()
    assert len(json.loads(line)["token_ids"]) == 3
