"""The `tagplan` command. Bad input prints one clear message and exits with code 2.

This module only builds the parser from the command groups and runs one command; each group
(`inspect`, `planning`, `learning`, `traces`, `demo`, `service`, `export`) lives in its own module.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from tagplan.cli.demo import add_demo_command
from tagplan.cli.export import add_export_commands
from tagplan.cli.inspect import add_inspect_commands
from tagplan.cli.learning import add_learning_commands
from tagplan.cli.options import EXIT_BAD_INPUT
from tagplan.cli.planning import add_planning_commands
from tagplan.cli.service import add_service_commands
from tagplan.cli.traces import add_trace_commands
from tagplan.errors import SpecError


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand."""
    parser = argparse.ArgumentParser(prog="tagplan", description="A planner for distributed deep-learning training.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log diagnostics to stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (add_inspect_commands, add_planning_commands, add_learning_commands, add_demo_command,
                add_trace_commands, add_service_commands, add_export_commands):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr)
    try:
        return int(args.func(args))
    except SpecError as exc:
        print(f"tagplan: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # `tagplan ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
    except OSError as exc:  # a file or folder the command was told to read or write: the path and what is wrong
        if args.verbose or not exc.filename:  # not a path (memory, a socket, a process): a fault, with its traceback
            raise
        print(f"tagplan: error: {exc.filename}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
