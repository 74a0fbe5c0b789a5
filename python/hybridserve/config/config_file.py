"""`--config FILE`: a subcommand's flags read from a YAML file, as vLLM's `--config`.

The file is a mapping of flag names (with or without the leading dashes, `-` or `_` alike) to
values, e.g. for `hybridserve serve --config serve.yaml`:

    model: demo
    port: 8001
    max-num-seqs: 32
    enable-prefix-caching: false
    served-model-name: [demo, tiny]
    speculative-config: {method: ngram, num_speculative_tokens: 3}

A flag given on the command line wins over the file's value: the file's value of a flag the
command line gives is left out, and the file's other flags go after the command line's own
(before a lone `--`), so that a list in the file cannot take a word of the command line for one
of its values. So does a MODEL given on the command line win over the file's `model`. A true
switch is the bare flag, a false one its `--no-` form (or nothing, for a flag that has none); a
single value is `--flag=value` (so that a value starting with `-` stays a value); a list is the
flag's values in order; a mapping is passed as its JSON text (the flags that take JSON). A key
that is not one of the subcommand's long flags, a value of the wrong shape or one the flag
refuses, two keys of one file for the same flag (`max-num-seqs` and `max_num_seqs`), a file that
is not a mapping or not YAML, an empty path: each is an error naming the file and the key.
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

    if not path.strip():  # (Path("") is the working folder)
        raise ConfigError(f"{FLAG}: empty; give a YAML file")
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


def _shown(v: Any) -> str:
    # (YAML also reads dates and times, which JSON has no form for)
    return json.dumps(v, default=str)


def _scalar(path: str, key: str, v: Any, action: argparse.Action | None = None) -> str:
    if isinstance(v, dict):
        text = _shown(v)
    elif isinstance(v, bool) or v is None or isinstance(v, list):
        raise ConfigError(f"{FLAG} {path}: {key} takes one value, got {_shown(v)}")
    elif not isinstance(v, str | int | float):
        raise ConfigError(f"{FLAG} {path}: {key}: {_shown(v)} (a {type(v).__name__}) is not a flag value")
    else:
        text = str(v)
    if action is not None:
        _check(path, key, action, text)
    return text


def _check(path: str, key: str, action: argparse.Action, text: str) -> None:
    """The flag's own check of a value, here, so that its error names the file and the key
    (argparse's would name only the flag). argparse runs the flag's type again: a type must
    have no side effects (none reads a file)."""
    value: Any = text
    if callable(action.type):
        try:
            value = action.type(text)
        except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
            plain = {int: "not an integer", float: "not a number"}  # (Python's words name a literal)
            why = plain.get(action.type) or str(e) or "not a value it takes"  # type: ignore[call-overload]
            shown = "" if text in why else f" (got {text})"  # (the flag's own words may say it)
            raise ConfigError(f"{FLAG} {path}: {key}: {why}{shown}") from None
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{FLAG} {path}: {key}: one of {', '.join(map(str, action.choices))} (got {text})")


def _flag_of(path: str, key: Any, actions: dict[str, argparse.Action]) -> tuple[str, argparse.Action]:
    """The long flag a file's key names, and its action."""
    if not isinstance(key, str) or not key.strip("-"):
        raise ConfigError(f"{FLAG} {path}: {key!r} is not a flag name")
    name = key.lstrip("-").replace("_", "-")
    flag = "--" + name
    action = actions.get(flag)
    if action is None and ("-" + name) in actions:  # a short flag (-tp): its long name is wanted
        long = [s for s in actions["-" + name].option_strings if s.startswith("--")]
        raise ConfigError(f"{FLAG} {path}: {key!r} is a short flag; write its long name ({', '.join(long)})")
    if action is None or flag == FLAG:
        raise ConfigError(f"{FLAG} {path}: {key!r} is not a flag of this command")
    return flag, action


def _tokens(path: str, key: str, flag: str, action: argparse.Action, value: Any) -> list[str]:
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ConfigError(f"{FLAG} {path}: {key} is true or false, got {_shown(value)}")
        positive = action.option_strings[0]
        if flag != positive:  # the key is the `no-` spelling: its true is the flag's false
            value = not value
        return [positive] if value else ["--no-" + positive[2:]]
    if action.nargs == 0:  # a switch (store_true / store_false / store_const)
        if not isinstance(value, bool):
            raise ConfigError(f"{FLAG} {path}: {key} is true or false, got {_shown(value)}")
        return [flag] if value else []
    if isinstance(action, argparse._AppendAction):  # (repeated: --prompt a --prompt b)
        return [
            f"{flag}={_scalar(path, key, v, action)}" for v in (value if isinstance(value, list) else [value])
        ]
    if action.nargs in ("+", "*"):
        values = value if isinstance(value, list) else [value]
        if not values and action.nargs == "+":
            raise ConfigError(f"{FLAG} {path}: {key} needs at least one value")
        return [flag, *(_scalar(path, key, v, action) for v in values)]
    return [f"{flag}={_scalar(path, key, value, action)}"]


def _given(argv: Sequence[str], actions: dict[str, argparse.Action]) -> set[str]:
    """The destinations of the flags the command line gives (`--flag`, `--flag=value`, `--no-flag`,
    short forms)."""
    out = set()
    for a in argv:
        action = actions.get(a.split("=", 1)[0]) if a.startswith("-") else None
        if action is not None:
            out.add(action.dest)
    return out


def expand_config_files(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[list[str], str | None]:
    """`argv` without its `--config FILE`s and with the files' flags that the command line does
    not give, after its own (before a lone `--`); and the files' `model`, for a subcommand whose
    MODEL is a positional (the caller takes it when the command line names none). Subcommands
    without a `--config` flag are left as they are."""
    start, sub = _subcommand_path(parser, argv)
    actions = _option_actions(sub)
    if FLAG not in actions:
        return list(argv), None
    paths, rest = _config_paths(argv, start)
    end = rest.index("--", start) if "--" in rest[start:] else len(rest)
    given = _given(rest[start:end], actions)
    positional_model = "--model" in actions and actions["--model"].dest != "model"
    model: str | None = None
    added: list[str] = []
    for path in paths:
        keys: dict[str, Any] = {}  # the file's key of each flag it sets (by destination)
        for key, value in _read(path).items():
            if positional_model and isinstance(key, str) and key.lstrip("-") == "model":
                model = _scalar(path, key, value)
                continue
            flag, action = _flag_of(path, key, actions)
            if action.dest in keys:  # (two spellings: the last would win without a word)
                raise ConfigError(
                    f"{FLAG} {path}: {keys[action.dest]!r} and {key!r} set the same flag; keep one"
                )
            keys[action.dest] = key
            if action.dest not in given:
                added += _tokens(path, key, flag, action, value)
    return rest[:end] + added + rest[end:], model
