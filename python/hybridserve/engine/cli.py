"""`hybridserve generate` (in progress)."""

from __future__ import annotations

import argparse


def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model folder, or 'demo' for the built-in demo model")


def generate_main(args: argparse.Namespace) -> int:
    raise SystemExit("hybridserve generate: not available yet")
