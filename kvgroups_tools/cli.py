"""The ``kvgroups`` command line: a registry of subcommands.

Each subcommand lives in its own module ``kvgroups_tools/cli_<name>.py`` exposing
``add_parser(subparsers)``, which adds its parser and sets ``func`` (called with the parsed
arguments, returning an exit status). Modules that are not installed are simply not offered;
a module that exists but fails to import raises, so breakage is never hidden.

Exit status: 0 done, 1 a check failed (bytes that differ, a benchmark backend that could not
load), 2 a bad option or input, refused in one line naming it before anything ran
(:mod:`kvgroups_tools.cli_options`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence

from kvgroups_core import __version__
from kvgroups_core.errors import KVGroupsError

from .cli_options import OneLineParser, stdout_closed_quietly

#: Subcommands in help order; each is ``kvgroups_tools.cli_<name>``.
SUBCOMMANDS: tuple[str, ...] = ("plan", "demo", "bench")


def available_subcommands() -> list[str]:
    """The subcommands whose module is present."""
    return [name for name in SUBCOMMANDS if importlib.util.find_spec(f"{__package__}.cli_{name}")]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every available subcommand registered."""
    parser = OneLineParser(
        prog="kvgroups",
        description="Plan and move paged KV-cache pages in LMCache-compatible chunks.",
    )
    parser.add_argument("--version", action="version", version=f"kvgroups {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in available_subcommands():
        module = importlib.import_module(f"{__package__}.cli_{name}")
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvgroups`` command; returns the exit status (see the module docstring)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or an option refused while parsing
        return exc.code if isinstance(exc.code, int) else 2
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe is met here, not in the interpreter's exit
        return status
    except KVGroupsError as exc:
        # Bad user input (a malformed spec, an invalid window): say so, without a traceback.
        print(f"kvgroups {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (kvgroups plan --json | head)
        stdout_closed_quietly()
        return 0
    except KeyboardInterrupt:
        print(f"kvgroups {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
