"""`hybridserve bench` (in progress)."""

from __future__ import annotations

import argparse


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("mode", choices=["serve", "offline"])


def bench_main(args: argparse.Namespace) -> int:
    raise SystemExit("hybridserve bench: not available yet")
