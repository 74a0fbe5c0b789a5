"""`hybridserve demo-model DIR` (in progress)."""

from __future__ import annotations

import argparse


def add_demo_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="folder to write the checkpoint into")


def demo_model_main(args: argparse.Namespace) -> int:
    raise SystemExit("hybridserve demo-model: not available yet")
