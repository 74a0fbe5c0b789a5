"""argparse value types the subcommands share: each refuses a bad value with one message, which
argparse prints after the flag's name (exit status 2)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An integer >= lo (and <= hi, when given)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if hi is None and v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        if hi is not None and not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {v}")
        return v

    return parse


def seconds(allow_zero: bool = False) -> Callable[[str], float]:
    """A finite number of seconds, > 0 (or >= 0 with allow_zero); nan is refused."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if allow_zero and not 0 <= v < math.inf:
            raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
        if not allow_zero and not 0 < v < math.inf:
            raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
        return v

    return parse


def role_name(text: str) -> str:
    """A name a chat message's `role` can carry (--response-role): 1 to 64 printable characters."""
    if not 0 < len(text) <= 64 or not text.isprintable():
        raise argparse.ArgumentTypeError(f"1 to 64 printable characters, got {text!r}")
    return text


def only_one(instead: str) -> Callable[[str], int]:
    """vLLM's size of a kind of parallelism this engine does not run: 1 is accepted (command lines
    written for vLLM give it), anything else is refused with what to use `instead`."""

    def parse(text: str) -> int:
        v = int_in(1)(text)
        if v != 1:
            raise argparse.ArgumentTypeError(f"only 1 here, got {v}: {instead}")
        return v

    return parse


def not_empty(what: str) -> Callable[[str], str]:
    """A value that must not be empty (an unset shell variable expands to one): `what` says what
    to give instead."""

    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"empty; {what}")
        return text

    return parse
