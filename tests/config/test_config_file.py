"""`--config FILE` (vLLM's): a subcommand's flags from a YAML mapping. The file's flags go first so
that the command line's own win; each shape of value becomes the tokens argparse takes; a file
or a key that cannot be used is an error naming it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
served-model-name: [demo, tiny]
speculative-config: {method: ngram, num_speculative_tokens: 3}
""",
    )
    argv, model = expand_config_files(build_parser(), ["serve", "--config", path, "--port", "9000"])
    assert model == "demo"
    assert argv == [
        "serve",
        "--port", "8001",
        "--max-num-seqs", "32",
        "--cpu-threads", "1",
        "--no-enable-prefix-caching",
        "--async-scheduling",
        "--trust-remote-code",
        "--served-model-name", "demo", "tiny",
        "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3}),
        "--port", "9000",
    ]  # fmt: skip
    args = build_parser().parse_args(argv)
    assert args.port == 9000 and args.max_num_seqs == 32  # (the command line's port wins)
    # the other spelling, and a subcommand under another (bench offline takes the engine flags)
    other = tmp_path / "offline.yaml"
    other.write_text("max-num-seqs: 4\n")
    argv, model = expand_config_files(
        build_parser(), ["bench", "offline", f"--config={other}", "--num-prompts", "2"]
    )
    assert (argv, model) == (["bench", "offline", "--max-num-seqs", "4", "--num-prompts", "2"], None)


def test_a_subcommand_without_the_flag_is_left_alone(tmp_path: Path) -> None:
    argv = ["demo-model", "out", "--config", "x.yaml"]
    assert expand_config_files(build_parser(), argv) == (argv, None)


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
    ],
)
def test_what_cannot_be_read_is_an_error_naming_the_file(tmp_path: Path, text: str, said: str) -> None:
    path = _file(tmp_path, text)
    with pytest.raises(ConfigError, match="--config .*flags.yaml") as e:
        expand_config_files(build_parser(), ["serve", "--config", path])
    assert said in str(e.value)


def _config(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hybridserve", "config", *args], capture_output=True, text=True, timeout=60
    )


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
    assert bad.returncode == 2 and "--max-num-seqs" in bad.stderr  # (argparse names the flag)
