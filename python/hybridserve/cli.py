"""`hybridserve` command line: serve | generate | config | bench | demo-model | replicas.

Each subcommand's handler lives beside the code it drives and is imported only when it runs, so
`hybridserve --version` and `hybridserve config` start without loading torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import select
import signal
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import NoReturn

from hybridserve import __version__

# subcommand -> (module, handler function, parser builder function or None)
_COMMANDS: dict[str, tuple[str, str, str]] = {
    "serve": ("hybridserve.server.cli", "serve_main", "add_serve_args"),
    "generate": ("hybridserve.engine.cli", "generate_main", "add_generate_args"),
    "config": ("hybridserve.config", "config_main", "add_config_args"),
    "bench": ("hybridserve.bench", "bench_main", "add_bench_args"),
    "demo-model": ("hybridserve.model.demo", "demo_model_main", "add_demo_model_args"),
    "replicas": ("hybridserve.deploy.replicas", "replicas_main", "add_replicas_args"),
}

_HELP = {
    "serve": "start the OpenAI-compatible HTTP server",
    "generate": "generate text offline for one or more prompts",
    "config": "resolve and print the engine configuration (--explain, --json)",
    "bench": "benchmarks: serving load generator, prefix-cache trace replay, offline throughput",
    "demo-model": "write the built-in demo checkpoint to a folder",
    "replicas": "start N serve replicas behind a router (vllm-router), or a router for --worker-urls",
}


def build_parser() -> argparse.ArgumentParser:
    # (no abbreviations: `--conf` would set --config's value without the file being read, and a
    # flag added later would change what an abbreviation means)
    parser = argparse.ArgumentParser(
        prog="hybridserve", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    parser.add_argument("--version", action="version", version=f"hybridserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, handler, builder) in _COMMANDS.items():
        p = sub.add_parser(name, help=_HELP[name], description=_HELP[name], allow_abbrev=False)
        module = importlib.import_module(module_name)
        getattr(module, builder)(p)
        p.set_defaults(_handler=(module_name, handler))
    return parser


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of `parser` and its subcommands' parsers."""
    out: set[str] = set()
    for action in parser._actions:
        out.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _flags(sub)
    return out


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end is closed (poll reports an error on it)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError):  # no file descriptor (a replaced sys.stdout), or no poll
        return False


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # (before a command's own handling: while the parser is built)
        given = sys.argv[1:] if argv is None else list(argv)
        command = f" {given[0]}" if given and not given[0].startswith("-") else ""
        print(f"hybridserve{command}: interrupted", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    from hybridserve.config.cli import normalize_flag_names, settle_model
    from hybridserve.config.config_file import expand_config_files
    from hybridserve.errors import ConfigError

    parser = build_parser()
    given = normalize_flag_names(sys.argv[1:] if argv is None else argv, _flags(parser))
    try:
        given, file_model = expand_config_files(parser, given)
    except ConfigError as exc:
        command = given[0] if given else "hybridserve"
        print(f"hybridserve {command}: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(normalize_flag_names(given, _flags(parser)))
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if file_model is not None and args.model is None and args.model_option is None:
        args.model_option = file_model  # (a MODEL on the command line wins over the file's)
    bad_model = settle_model(args)
    if bad_model is not None:
        print(f"hybridserve {args.command}: error: {bad_model}", file=sys.stderr)
        return 2
    module_name, handler_name = args._handler
    handler: Callable[[argparse.Namespace], int | None] = getattr(
        importlib.import_module(module_name), handler_name
    )
    from hybridserve.errors import InvalidRequestError

    try:
        rc = handler(args)
        sys.stdout.flush()  # (a reader that went away shows here, not in a flush at exit)
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise  # another pipe or socket broke: not the user's doing
        # stdout's reader went away (`hybridserve config demo --json | head -1`): stop quietly with
        # the status of a process that SIGPIPE ended, as other command-line tools do; what is
        # still buffered goes nowhere instead of into an error at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt:
        # Ctrl-C: one line and the shell's status for SIGINT, not a traceback
        print(f"hybridserve {args.command}: interrupted", file=sys.stderr)
        return 130
    except (ConfigError, InvalidRequestError) as exc:
        # a user error is one line on stderr and exit status 2, as argparse's own errors are
        print(f"hybridserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (
        FileNotFoundError,
        FileExistsError,
        NotADirectoryError,
        IsADirectoryError,
        PermissionError,
    ) as exc:
        # a path the user gave (demo-model DIR, --result-file, a model folder); other OSErrors
        # are not the user's and keep their traceback
        print(f"hybridserve {args.command}: error: {exc}", file=sys.stderr)
        return 1
    return int(rc or 0)


def run() -> NoReturn:
    """The `hybridserve` command: `main`, then the process's end. Where a grammar compilation
    still runs (a shutdown waited for it in vain), the process ends at once, its output flushed:
    ended by the interpreter's finalization, the compiling thread would be unwound through
    llguidance's native frames and the process crash (SIGSEGV) instead of exiting with `main`'s
    status."""
    try:
        rc = main()
    except SystemExit as exc:  # (argparse's errors, --help)
        if not _compilations_running():
            raise
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        rc = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except KeyboardInterrupt:  # (outside the command's own handling: the shell's status for it)
        if not _compilations_running():
            raise
        print("hybridserve: interrupted", file=sys.stderr)
        rc = 130
    except BaseException:  # (an error main does not handle: its traceback, then status 1)
        if not _compilations_running():
            raise
        traceback.print_exc()
        rc = 1
    if _compilations_running():
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(rc)
    sys.exit(rc)


def _compilations_running() -> bool:
    compiler = sys.modules.get("hybridserve.engine.grammar_compiler")  # (not imported for it)
    return compiler is not None and bool(compiler.compilations_running())


if __name__ == "__main__":
    run()
