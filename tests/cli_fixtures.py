"""Running a `hybridserve` command by its own entry point inside the test process: a process of
its own per call imports torch each time (seconds), which commands that only read flags and
config files do not need to pay. Tests that need a real process (pipes, signals, a fresh
interpreter) start one."""

from __future__ import annotations

import contextlib
import io
import subprocess


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """`hybridserve ARGV`'s exit status and output, as a finished process's."""
    from hybridserve.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as e:  # (argparse's usage errors)
            rc = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(["hybridserve", *argv], rc, out.getvalue(), err.getvalue())
