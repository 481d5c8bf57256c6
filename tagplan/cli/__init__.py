"""The `tagplan` command: `main` parses the arguments and runs one subcommand (see `cli.main`).

`cli.options` holds what the command groups share; each group lives in its own module.
"""

from tagplan.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
