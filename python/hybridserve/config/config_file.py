"""`--config FILE`: a subcommand's flags read from a YAML file, as vLLM's `--config`.

The file is a mapping of flag names (with or without the leading dashes, `-` or `_` alike) to
values, e.g. for `hybridserve serve --config serve.yaml`:

    model: demo
    port: 8001
    max-num-seqs: 32
    enable-prefix-caching: false
    served-model-name: [demo, tiny]
    speculative-config: {method: ngram, num_speculative_tokens: 3}

A flag given on the command line wins over the file's value, wherever it stands: the file's flags
are put first, right after the subcommand, and argparse keeps the last value it reads. So does a
MODEL given on the command line over the file's `model`. A true switch is the bare flag, a false
one its `--no-` form (or nothing, for a flag that has none); a list is the flag's values in
order; a mapping is passed as its JSON text (the flags that take JSON). A key that is not one of
the subcommand's flags, a value of the wrong shape, a file that is not a mapping or not YAML:
each is an error naming the file and the key.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridserve.errors import ConfigError

FLAG = "--config"


def _option_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings}


def _subcommand_path(
    parser: argparse.ArgumentParser, argv: Sequence[str]
) -> tuple[int, argparse.ArgumentParser]:
    """(index after the subcommand's words in `argv`, that subcommand's parser)."""
    i, current = 0, parser
    while i < len(argv):
        subs = [a for a in current._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or argv[i] not in subs[0].choices:
            break
        current = subs[0].choices[argv[i]]
        i += 1
    return i, current


def _config_paths(argv: Sequence[str], start: int) -> tuple[list[str], list[str]]:
    """(the --config values, argv without them), looking from `start` up to a lone `--`."""
    paths: list[str] = []
    rest = list(argv[:start])
    i = start
    while i < len(argv):
        a = argv[i]
        if a == "--":
            rest += argv[i:]
            break
        if a == FLAG:
            if i + 1 >= len(argv):
                raise ConfigError(f"{FLAG} needs a FILE")
            paths.append(argv[i + 1])
            i += 2
            continue
        if a.startswith(FLAG + "="):
            paths.append(a[len(FLAG) + 1 :])
        else:
            rest.append(a)
        i += 1
    return paths, rest


def _read(path: str) -> dict[str, Any]:
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{FLAG} {path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{FLAG} {path}: not UTF-8 text") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{FLAG} {path}: not YAML: {' '.join(str(e).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{FLAG} {path}: must be a mapping of flag names to values, got {type(data).__name__}"
        )
    return data


def _scalar(path: str, key: str, v: Any) -> str:
    if isinstance(v, dict):
        return json.dumps(v)
    if isinstance(v, bool) or v is None or isinstance(v, list):
        raise ConfigError(f"{FLAG} {path}: {key} takes one value, got {json.dumps(v)}")
    if not isinstance(v, str | int | float):
        raise ConfigError(f"{FLAG} {path}: {key}: a {type(v).__name__} is not a flag value")
    return str(v)


def _tokens(path: str, key: Any, value: Any, actions: dict[str, argparse.Action]) -> list[str]:
    if not isinstance(key, str) or not key.strip("-"):
        raise ConfigError(f"{FLAG} {path}: {key!r} is not a flag name")
    flag = "--" + key.lstrip("-").replace("_", "-")
    action = actions.get(flag)
    if action is None or flag == FLAG:
        raise ConfigError(f"{FLAG} {path}: {key!r} is not a flag of this command")
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ConfigError(f"{FLAG} {path}: {key} is true or false, got {json.dumps(value)}")
        return [flag] if value else ["--no-" + flag[2:]]
    if action.nargs == 0:  # a switch (store_true / store_false / store_const)
        if not isinstance(value, bool):
            raise ConfigError(f"{FLAG} {path}: {key} is true or false, got {json.dumps(value)}")
        return [flag] if value else []
    if action.nargs in ("+", "*"):
        values = value if isinstance(value, list) else [value]
        if not values and action.nargs == "+":
            raise ConfigError(f"{FLAG} {path}: {key} needs at least one value")
        return [flag, *(_scalar(path, key, v) for v in values)]
    return [flag, _scalar(path, key, value)]


def expand_config_files(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[list[str], str | None]:
    """`argv` with each `--config FILE` replaced by the file's flags, put right after the
    subcommand (so that the command line's own flags win); and the files' `model`, for a command
    line that names none. Subcommands without a `--config` flag are left as they are."""
    start, sub = _subcommand_path(parser, argv)
    actions = _option_actions(sub)
    if FLAG not in actions:
        return list(argv), None
    paths, rest = _config_paths(argv, start)
    model: str | None = None
    inserted: list[str] = []
    for path in paths:
        for key, value in _read(path).items():
            if isinstance(key, str) and key.lstrip("-").replace("_", "-") == "model":
                model = _scalar(path, key, value)
                continue
            inserted += _tokens(path, key, value, actions)
    return rest[:start] + inserted + rest[start:], model
