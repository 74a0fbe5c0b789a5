"""EngineArgs and `hybridserve config` (in progress)."""

from __future__ import annotations

import argparse


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model folder, or 'demo' for the built-in demo model")


def config_main(args: argparse.Namespace) -> int:
    raise SystemExit("hybridserve config: not available yet")
